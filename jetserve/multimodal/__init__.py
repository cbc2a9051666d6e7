"""Image input for jet_vlm models: decoding and limits, preprocessing per the checkpoint's processor config, and the
per-request image embeddings spliced into prefill."""
