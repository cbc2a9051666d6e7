"""Training of small Jet-Nemotron models and their EAGLE-3 drafts: corpus, tokenizer, pretraining, draft training."""
