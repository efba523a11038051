"""web/head_first.py: the page's first script, put in on the way out (a real Starlette app under the middleware)."""
from __future__ import annotations

from starlette.applications import Starlette
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from web.head_first import HeadFirst

PAGE = "<!doctype html><html><head><title>x</title></head><body>hi</body></html>"


def client() -> TestClient:
    app = Starlette(routes=[Route("/", lambda r: HTMLResponse(PAGE), methods=["GET", "HEAD"]),
                            Route("/text", lambda r: PlainTextResponse("<head>")),
                            Route("/config", lambda r: JSONResponse({"head": "<head>"}))])
    return TestClient(HeadFirst(app, "window.first = 1;"))


def test_an_html_page_gets_the_script_first_in_its_head_and_its_length():
    got = client().get("/")
    assert got.text == PAGE.replace("<head>", "<head><script>window.first = 1;</script>")
    assert int(got.headers["content-length"]) == len(got.content)
    assert int(client().head("/").headers["content-length"]) == len(got.content)  # HEAD says what GET sends


def test_other_responses_pass_untouched():
    c = client()
    assert c.get("/text").text == "<head>"
    assert c.get("/config").json() == {"head": "<head>"}
    assert c.post("/").status_code == 405
