"""Images through the real server on 127.0.0.1 (tiny-vlm): a chat request with an image_url part returns tokens, and
every bad image input is a 400 whose message names the problem and the part."""

import http.server
import threading

import httpx
import pytest
from vlm_helpers import data_url, png_bytes

from jetserve.multimodal.processor import ImageLimits


def _chat(base_url: str, content, **fields) -> httpx.Response:
    body = {"model": "tiny-vlm", "messages": [{"role": "user", "content": content}], "max_tokens": 5,
            "temperature": 0.0} | fields  # fmt: skip
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_request_returns_tokens(vlm_server):
    server, base_url = vlm_server
    png = png_bytes(30, 50, seed=0)
    r = _chat(base_url, [_image(data_url(png)), {"type": "text", "text": "What is in the image?"}], n=2)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 10 and len(body["choices"]) == 2
    assert body["choices"][0]["message"]["content"] == body["choices"][1]["message"]["content"]  # greedy, same image
    text_only = _chat(base_url, "What is in the image?").json()["usage"]["prompt_tokens"]
    # One image of aspect 0.6 → a 1x2 grid + thumbnail: its placeholder becomes 3 tiles x (9 image tokens + 2 LF).
    assert body["usage"]["prompt_tokens"] == text_only + 3 * (9 + 2)
    # Two images in one message (one tile each, no tiling) and a streamed answer.
    two = [{"type": "text", "text": "compare "}, _image(data_url(png)), _image(data_url(png_bytes(8, 8, 1)))]
    r = _chat(base_url, two, stream=True)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize(
    "content, status, message",
    [
        ([_image("data:image/png;base64,not*base64")], 400, "messages.0.content.0.image_url: the data URL's base64"),
        ([_image(data_url(b"GIF89a-but-not-really"))], 400, "messages.0.content.0.image_url: not a decodable image"),
        ([{"type": "text", "text": "x"}, _image("http://127.0.0.1:9/cat.png")], 400,
         "messages.0.content.1.image_url: this server does not fetch image URLs"),
        ([_image("ftp://example.com/cat.png")], 400, "messages.0.content.0.image_url: unsupported URL"),
        ([_image(data_url(png_bytes(300, 300, 2)))], 400, "messages.0.content.0.image_url: image too large"),
        ([_image(data_url(png_bytes(4, 4, 3)))] * 3, 400, "messages: 3 images; at most 2 per request"),
        ([{"type": "text", "text": "<image> and "}, _image(data_url(png_bytes(4, 4, 3)))], 400,
         "messages: the prompt has 2 image placeholder(s) for 1 image(s)"),
        ([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}], 400,
         "messages.0.content: must be"),
    ],
)  # fmt: skip
def test_bad_images_are_400(vlm_server, monkeypatch, content, status, message):
    server, base_url = vlm_server
    monkeypatch.setattr(server, "image_limits", ImageLimits(max_images_per_request=2, max_image_pixels=200 * 200))
    r = _chat(base_url, content)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"].startswith(message), error
    assert error["param"] == message.split(":")[0]


def test_image_urls_fetched_only_when_allowed(vlm_server, monkeypatch):
    server, base_url = vlm_server
    png = png_bytes(12, 12, seed=5)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body, code = (png, 200) if self.path == "/cat.png" else (b"no", 404)
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    images = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{images.server_address[1]}"
        monkeypatch.setattr(server, "allow_image_urls", True)
        fetched = _chat(base_url, [_image(url + "/cat.png"), {"type": "text", "text": "?"}])
        assert fetched.status_code == 200, fetched.text
        inline = _chat(base_url, [_image(data_url(png)), {"type": "text", "text": "?"}])
        assert fetched.json()["choices"][0]["message"] == inline.json()["choices"][0]["message"]
        missing = _chat(base_url, [_image(url + "/missing.png")])
        assert missing.status_code == 400 and "HTTP 404" in missing.json()["error"]["message"]
    finally:
        images.shutdown()
