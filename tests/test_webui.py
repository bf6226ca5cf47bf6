"""The chat page at `/` in a real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium) against a live server on 127.0.0.1 on a tiny Kimi-K3 GGUF with Kimi-K2's tool template: send a
message and see the streamed answer (equal to the API's own answer), stop a generation, see a tool call.
Skipped with the reason when the browser, its driver or selenium is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import httpx
import jsonschema
import openai
import pytest

from chat_models import KIMI_TOOL_TEMPLATE, retokenized
from k3stream import LoadOptions
from k3stream.engine.loading import load_runtime
from k3stream.server.app import ServerConfig, create_app
from k3stream.server.live import ServerThread
from k3stream.server.runtime import served_from_runtime
from live_server import keyed_server

KEY = "sk-test-webui"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
WAIT_S = 120

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _browser_or_skip() -> tuple[str, str]:
    pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("Chromium or chromedriver is missing (apt-get install -y chromium chromium-driver)")
    return chromium, driver


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, driver_path = _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,860"):
        options.add_argument(flag)
    # Chromium's profile, singleton socket and chromedriver's scoped dirs go under pytest's tmp folder
    scratch = tmp_path_factory.mktemp("chromium")
    options.add_argument(f"--user-data-dir={scratch / 'profile'}")
    service = Service(driver_path, env={**os.environ, "TMPDIR": str(scratch)})
    driver = webdriver.Chrome(service=service, options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def tool_gguf(tiny_model, tmp_path_factory):
    source = tiny_model(vocab=600, context_length=2048)
    out = tmp_path_factory.mktemp("webui") / "kimi-webui.gguf"
    return retokenized(source, out, chat_template=KIMI_TOOL_TEMPLATE, special_tokens=("<think>", "</think>"))


@pytest.fixture(scope="module")
def tool_pack(tool_gguf, tmp_path_factory):
    """The model's routed experts packed by the real packer, streamed through the expert store."""
    from k3stream.pack.builder import BuildOptions, build_pack

    out = tmp_path_factory.mktemp("webui-pack")
    manifest = out / "kimi-webui.manifest.json"
    build_pack(tool_gguf, out / "kimi-webui.pack", manifest, BuildOptions(progress=False))
    return manifest


@pytest.fixture(scope="module")
def server(tool_pack):
    served = served_from_runtime(load_runtime(tool_pack, LoadOptions(expert_ram_mib=1)), ctx=2048)
    with keyed_server(served, KEY, max_batch=2) as thread:
        yield thread
    served.close()


@pytest.fixture()
def page(browser, server):
    """The page, freshly loaded with empty storage and the API key filled in."""
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(server.url + "/")
    settings = {"api-key": KEY, "temperature": "0", "max_tokens": "24"}
    _fill(browser, settings)
    return browser


def _fill(browser, fields: dict[str, str]) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    for field, value in fields.items():
        element = browser.find_element(By.ID, field)
        if element.tag_name == "select":
            Select(element).select_by_visible_text(value)
        else:
            element.clear()
            element.send_keys(value)


def _send(browser, text: str) -> None:
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, "input").send_keys(text)
    browser.find_element(By.ID, "send").click()


def _wait(browser, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, WAIT_S, poll_frequency=0.05).until(lambda _: condition(), message=what)


def _stats(browser) -> str:
    return browser.execute_script(
        "const s = document.querySelector('.msg.assistant:last-child .stats'); return s ? s.textContent : ''"
    )


def _stored_answer(browser) -> dict:
    conversations = json.loads(
        browser.execute_script("return localStorage.getItem('k3stream.conversations')")
    )
    return conversations[0]["messages"][-1]


def test_a_message_streams_the_apis_answer(page, server):
    _send(page, "Tell me about Paris")
    _wait(page, lambda: "tokens/s" in _stats(page), "the answer finished")
    answer = _stored_answer(page)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    expected = client.chat.completions.create(
        messages=[{"role": "user", "content": "Tell me about Paris"}],
        model="kimi-webui",
        temperature=0,
        max_tokens=24,
    )
    assert answer["content"] == (expected.choices[0].message.content or "")
    stats = _stats(page)
    assert f"{expected.usage.completion_tokens} tokens" in stats and "tokens/s" in stats
    assert re.search(r"\d+\.\d% expert hits, [\d.]+ [KMG]?B read", stats), stats
    shown = page.execute_script("return document.querySelector('.msg.assistant .content').textContent")
    assert shown.strip(), "the answer was not shown"
    assert "Tell me about Paris" in page.execute_script(
        "return document.getElementById('conversations').textContent"
    )


def test_stop_ends_a_generation(page, server):
    before = httpx.get(server.url + "/health", timeout=10).json()["cancelled_jobs"]
    _fill(page, {"max_tokens": "1900", "extra": '{"ignore_eos": true}'})
    _send(page, "Count to a thousand")
    _wait(page, lambda: page.execute_script("return !document.getElementById('stop').disabled"), "streaming")
    _wait(page, lambda: _stored_or_shown_text(page), "the first text")
    page.find_element("id", "stop").click()
    _wait(page, lambda: _stats(page).startswith("stopped"), "the stop")
    assert page.execute_script("return document.getElementById('stop').disabled")
    deadline = time.monotonic() + WAIT_S
    while httpx.get(server.url + "/health", timeout=10).json()["cancelled_jobs"] == before:
        assert time.monotonic() < deadline, "the server never dropped the stopped sequence"
        time.sleep(0.05)
    assert _stored_answer(page)["content"], "the partial answer was not kept"


def _stored_or_shown_text(page) -> bool:
    return bool(page.execute_script("return document.querySelector('.msg.assistant .content').textContent"))


def test_a_tool_call_is_shown(page):
    _fill(page, {"tools": json.dumps(TOOLS), "tool_choice": "required", "max_tokens": "120"})
    _send(page, "Weather in Paris?")
    _wait(page, lambda: "tokens/s" in _stats(page), "the answer finished")
    name = page.execute_script("return document.querySelector('.tool-call .name').textContent")
    arguments = page.execute_script("return document.querySelector('.tool-call pre').textContent")
    assert name == "tool call: get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert _stored_answer(page)["tool_calls"][0]["function"]["name"] == "get_weather"


def test_reasoning_is_shown_folded(page):
    """The template opens a think block: the answer is reasoning, shown in a closed <details>."""
    _fill(page, {"extra": '{"chat_template_kwargs": {"thinking": true}}', "max_tokens": "16"})
    _send(page, "Think first")
    _wait(page, lambda: "tokens/s" in _stats(page), "the answer finished")
    reasoning = _stored_answer(page)["reasoning"]
    assert reasoning
    folded = page.execute_script(
        "const d = document.querySelector('.msg.assistant details.reasoning');"
        "return d ? [d.open, d.querySelector('summary').textContent, d.textContent] : null"
    )
    assert folded[0] is False and folded[1] == "Reasoning"
    assert "".join(reasoning.split()) in "".join(folded[2].split())


# the page's number fields for the chat request's fields of the same names (the seed's range is past
# what a page's numbers hold exactly)
NUMBER_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "frequency_penalty", "presence_penalty")


def _api_range(field: str) -> tuple[float | None, float | None]:
    """The least and greatest value the chat API takes for `field` (None: no bound)."""
    from k3stream.server.schemas import ChatCompletionRequest

    schema = ChatCompletionRequest.model_json_schema()["properties"][field]
    (number,) = [option for option in schema["anyOf"] if option["type"] != "null"]
    return number.get("minimum"), number.get("maximum")


def test_the_number_fields_take_the_range_the_api_takes(page, server):
    """Each sampling field's bounds are the API's (a temperature above 2 included); a temperature
    stepped up past 2 with the arrow key is valid and the server runs the request with it."""
    from selenium.webdriver.common.keys import Keys

    for field in NUMBER_FIELDS:
        shown = page.execute_script(
            "const e = document.getElementById(arguments[0]); return [e.min, e.max]", field
        )
        page_range = tuple(float(bound) if bound else None for bound in shown)
        assert page_range == _api_range(field), field
    _fill(page, {"temperature": "2"})
    page.find_element("id", "temperature").send_keys(Keys.ARROW_UP)
    stepped = page.execute_script(
        "const e = document.getElementById('temperature'); return [e.value, e.checkValidity()]"
    )
    assert stepped == ["2.05", True]
    _send(page, "Hot take")
    _wait(page, lambda: "tokens/s" in _stats(page), "the answer finished")
    slots = httpx.get(server.url + "/slots", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert 2.05 in [slot.get("params", {}).get("temperature") for slot in slots]


def test_wrong_api_key_shows_the_servers_error(page):
    _fill(page, {"api-key": "wrong"})
    _send(page, "hi")
    _wait(page, lambda: page.execute_script("return !!document.querySelector('.stats.error')"), "an error")
    error = page.execute_script("return document.querySelector('.stats.error').textContent")
    assert "API key" in error


def test_markdown_escapes_html(page):
    source = (
        "<script>alert(1)</script> **bold** `a<b>` [x](javascript:alert(1))\n\n"
        "```py\n<i>x</i>\n```\n- one\n- two"
    )
    html = page.execute_script("return markdown(arguments[0])", source)
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "<strong>bold</strong>" in html and "<code>a&lt;b&gt;</code>" in html
    assert '<pre><code data-lang="py">&lt;i&gt;x&lt;/i&gt;</code></pre>' in html
    assert "<ul><li>one</li><li>two</li></ul>" in html
    assert "<a " not in html, "a javascript: link became a link"


def test_page_is_self_contained_and_can_be_turned_off(server, tool_gguf):
    response = httpx.get(server.url + "/", timeout=10)
    assert response.status_code == 200 and "connect-src 'self'" in response.headers["content-security-policy"]
    assert "src=" not in response.text and "<link" not in response.text
    served = served_from_runtime(load_runtime(tool_gguf), ctx=256)
    with ServerThread(create_app(served, ServerConfig(webui=False))) as off:
        assert httpx.get(off.url + "/", timeout=10).status_code == 404
    served.close()
