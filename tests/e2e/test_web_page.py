"""The chat page at `/` in a real browser (chromium driven by Playwright; `make browser` installs one) against the
product stack: the key prompt, sending, streaming, reload, Stop, Regenerate, rating, a dropped network
mid-reply, a reply attached to on load, and a refused send. Every wait is on the page's DOM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import nats
import pytest
import pytest_asyncio
from helpers import next_heartbeat, service_env, service_process, wait_until
from product_stack import ALICE, API_KEYS

from tandem.bus.events import now_ms
from tandem.devstack.servers import init_token_stream, start_nats
from tandem.store import Conversation, NewMessage, Role
from tandem.store.sqlite import SqliteStore

# Where a browser is required (CI sets TANDEM_REQUIRE_BROWSER=1), a missing one fails every test
# here (not the collection, which would stop the whole run) instead of skipping them.
IS_BROWSER_REQUIRED = os.environ.get("TANDEM_REQUIRE_BROWSER") == "1"
HOW_TO_GET_ONE = "run `make browser` (apt-get install chromium as root, or python -m playwright install chromium)"

try:
    from playwright import async_api, sync_api
except ImportError:
    if not IS_BROWSER_REQUIRED:
        raise pytest.skip.Exception("playwright is not installed (pip install -e .[dev])", allow_module_level=True) from None
    async_api = sync_api = None


def chromium_path() -> str | None:
    """A system chromium, else Playwright's own download when it is there, else None."""
    system = shutil.which("chromium") or shutil.which("chromium-browser")
    if system or sync_api is None:
        return system
    with sync_api.sync_playwright() as playwright:
        bundled = Path(playwright.chromium.executable_path)
    return str(bundled) if bundled.is_file() else None


CHROMIUM = chromium_path()
NO_BROWSER = "" if CHROMIUM else f"no chromium (or no playwright) for the browser tests: {HOW_TO_GET_ONE}"
if NO_BROWSER and not IS_BROWSER_REQUIRED:
    pytest.skip(NO_BROWSER, allow_module_level=True)
expect = async_api.expect if async_api else None
pytestmark = pytest.mark.real_model

REPLY_TIMEOUT_MS = 90_000
LONG_PROMPT = "Count from 1 to 200, separated by commas."
# The stack caps answers at 48 tokens, about a second here: a test that acts on a running reply (stop,
# reload, cut) asks for more, so the reply is surely still running when its action lands on a busy machine.
# Greedily: sampled at the page's 0.7, the answer is sometimes "200." (five tokens), over before the action.
LONG_REPLY_TOKENS = 240
# Records the lengths a running reply's text goes through, to tell streaming from one late block.
RECORD_GROWTH = """
window.__growth = [];
new MutationObserver(() => {
  const el = document.querySelector('.message[data-role="assistant"][data-status="running"] .content');
  const len = el ? el.textContent.length : 0;
  if (len && window.__growth.at(-1) !== len) window.__growth.push(len);
}).observe(document, {subtree: true, childList: true, characterData: true});
"""

# Anything the page's Content-Security-Policy blocks is a page bug (or an attack): report it.
REPORT_CSP_VIOLATIONS = """
document.addEventListener('securitypolicyviolation', (e) => {
  console.error(`tandem: the Content-Security-Policy blocked ${e.violatedDirective} ${e.blockedURI}`);
});
"""


class CuttableProxy:
    """A TCP proxy in front of a chat instance whose connections the test can cut, as a dropped
    network does; later connections go to `upstream`, which the test may switch."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.url = ""
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, client_reader, client_writer) -> None:
        target = urlsplit(self.upstream)
        upstream_reader, upstream_writer = await asyncio.open_connection(target.hostname, target.port)
        self._writers |= {client_writer, upstream_writer}
        await asyncio.gather(self._pipe(client_reader, upstream_writer), self._pipe(upstream_reader, client_writer))

    async def _pipe(self, reader, writer) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        self._close(writer)

    def _close(self, writer) -> None:
        self._writers.discard(writer)
        writer.close()

    def cut(self) -> int:
        """Closes every open connection; returns how many there were."""
        writers = list(self._writers)
        for writer in writers:
            self._close(writer)
        return len(writers)

    async def stop(self) -> None:
        self.cut()
        self._server.close()


@pytest_asyncio.fixture
async def proxy(product_stack):
    proxy = CuttableProxy(product_stack.chat_urls[0])
    await proxy.start()
    yield proxy
    await proxy.stop()


@pytest_asyncio.fixture(scope="module")
async def browser():
    if NO_BROWSER:
        pytest.fail(f"{NO_BROWSER} (TANDEM_REQUIRE_BROWSER=1)", pytrace=False)
    async with async_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        await browser.close()


@pytest_asyncio.fixture
async def context(browser):
    """A fresh browser profile (no stored key); fails the test on any uncaught error in the page
    and on the page's own error reports (console lines starting "tandem:")."""
    context = await browser.new_context()
    await context.add_init_script(RECORD_GROWTH)
    await context.add_init_script(REPORT_CSP_VIOLATIONS)
    page_errors = []
    context.on("weberror", lambda error: page_errors.append(str(error.error)))
    context.on("console", lambda message: page_errors.append(message.text) if message.text.startswith("tandem:") else None)
    yield context
    await context.close()
    assert not page_errors, f"the page reported errors: {page_errors}"


async def signed_in_page(context, url: str, first_key: str = ""):
    """A page at `/` with the API key entered in its prompt (after `first_key`, if given, was refused)."""
    page = await context.new_page()
    await page.goto(url + "/")
    await expect(page.locator("#key-dialog")).to_be_visible()
    if first_key:
        await page.fill("#api-key", first_key)
        await page.click("#save-key")
        await expect(page.locator("#key-error")).to_contain_text("refused")
        await expect(page.locator("#key-dialog")).to_be_visible()
    await page.fill("#api-key", "key-alice")
    await page.click("#save-key")
    await expect(page.locator("#key-dialog")).to_be_hidden()
    return page


async def source_of(answer) -> str:
    """The text an answer on the page was rendered from (its Markdown), as streamed or loaded."""
    return await answer.get_attribute("data-source") or ""


def answers(page):
    return page.locator('.message[data-role="assistant"]')


async def send(page, text: str) -> None:
    await page.fill("#input", text)
    await page.press("#input", "Enter")


async def send_long(page) -> None:
    """Sends LONG_PROMPT with the page's own request, given `max_tokens` LONG_REPLY_TOKENS and
    `temperature` 0 on its way."""

    async def with_max_tokens(route):
        if route.request.method != "POST":
            await route.continue_()
            return
        body = json.loads(route.request.post_data or "{}")
        await route.continue_(post_data=json.dumps({**body, "max_tokens": LONG_REPLY_TOKENS, "temperature": 0}))

    pattern = re.compile(r".*/v1/conversations/[^/]+/messages$")
    await page.route(pattern, with_max_tokens)
    await send(page, LONG_PROMPT)
    await expect(answers(page).last).to_have_attribute("data-id", re.compile(".+"), timeout=REPLY_TIMEOUT_MS)
    await page.unroute(pattern, with_max_tokens)


def conversation_id_of(page) -> str:
    conversation_id = page.url.partition("#")[2]
    assert conversation_id, f"the page did not put the conversation in its URL: {page.url}"
    return conversation_id


async def stored(url: str, conversation_id: str, settled: bool = True) -> dict:
    """The conversation as the API has it; `settled`: once its last answer is no longer running."""

    async def read():
        async with httpx.AsyncClient(base_url=url, headers=ALICE) as client:
            response = await client.get(f"/v1/conversations/{conversation_id}")
        assert response.status_code == 200, response.text
        conversation = response.json()
        if settled and conversation["messages"][-1]["status"] == "running":
            return None
        return conversation

    return await wait_until(read, timeout_s=30)


async def wait_for_first_words(page, answer) -> None:
    await expect(answer.locator(".content")).not_to_have_text("", timeout=REPLY_TIMEOUT_MS)
    await expect(answer).to_have_attribute("data-status", "running")


async def test_key_prompt_send_stream_and_reload(product_stack, context):
    async with httpx.AsyncClient(base_url=product_stack.url, headers=ALICE) as client:
        older = (await client.post("/v1/conversations", json={"title": "an older chat"})).json()["id"]
    page = await signed_in_page(context, product_stack.url, first_key="not-a-key")
    question = "Say hello to <b>Ada</b> & <i>Bob</i> in one short sentence."
    await page.click("#new-chat")
    await page.fill("#input", "Say hello")
    await page.press("#input", "Shift+Enter")
    await expect(page.locator("#input")).to_have_value("Say hello\n")
    await expect(page.locator(".message")).to_have_count(0)
    await send(page, question)

    user = page.locator('.message[data-role="user"]')
    await expect(user.locator(".content")).to_have_text(question)
    answer = answers(page).last
    await expect(answer).to_have_attribute("data-status", "complete", timeout=REPLY_TIMEOUT_MS)
    assert await page.locator("#messages b, #messages i").count() == 0, "message text was rendered as HTML"
    await expect(page.locator("#input")).to_have_value("")

    conversation_id = conversation_id_of(page)
    conversation = await stored(product_stack.url, conversation_id)
    shown = await answer.locator(".content").text_content()  # as rendered
    source = await source_of(answer)
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"]
    assert conversation["messages"][0]["content"] == question
    assert source == conversation["messages"][1]["content"] and shown.strip()
    tokens = conversation["messages"][1]["tokens"]
    await expect(answer.locator(".usage")).to_have_text(f"{tokens} tokens")

    await page.reload()
    await expect(page.locator("#key-dialog")).to_be_hidden()
    links = page.locator("#conversations a")
    await expect(links.first).to_have_attribute("data-id", conversation_id)
    await expect(links.first).to_have_text(conversation["title"])
    await expect(page.locator(f'#conversations a[data-id="{older}"]')).to_have_text("an older chat")
    await expect(page.locator(".message")).to_have_count(2)
    await expect(user.locator(".content")).to_have_text(question)
    await expect(answers(page).last).to_have_attribute("data-source", source)
    await expect(answers(page).last.locator(".content")).to_have_text(shown)
    await expect(answers(page).last).to_have_attribute("data-status", "complete")
    await expect(answers(page).last.locator(".usage")).to_have_text(f"{tokens} tokens")


async def test_stop_mid_reply_keeps_the_partial_text_as_stopped(product_stack, context):
    page = await signed_in_page(context, product_stack.url)
    await send_long(page)
    answer = answers(page).last
    await wait_for_first_words(page, answer)
    await page.click("#stop")

    await expect(answer).to_have_attribute("data-status", "stopped", timeout=REPLY_TIMEOUT_MS)
    await expect(answer.locator(".status")).to_have_text("Stopped")
    await expect(page.locator("#send")).to_be_visible()
    conversation = await stored(product_stack.url, conversation_id_of(page))
    last = conversation["messages"][-1]
    source = await source_of(answer)
    assert last["status"] == "stopped"
    assert source == last["content"] and source.strip(), (source, last)

    await page.reload()
    await expect(answers(page).last).to_have_attribute("data-status", "stopped")
    await expect(answers(page).last).to_have_attribute("data-source", source)


async def test_regenerate_gives_a_new_answer(product_stack, context):
    page = await signed_in_page(context, product_stack.url)
    await send(page, "Name a colour.")
    answer = answers(page).last
    await expect(answer).to_have_attribute("data-status", "complete", timeout=REPLY_TIMEOUT_MS)
    first_id = await answer.get_attribute("data-id")

    await answer.locator(".regenerate").click()
    await expect(answer).to_have_attribute("data-status", "complete", timeout=REPLY_TIMEOUT_MS)
    second_id = await answer.get_attribute("data-id")
    assert second_id and second_id != first_id
    await expect(answers(page)).to_have_count(1)

    conversation = await stored(product_stack.url, conversation_id_of(page))
    last = conversation["messages"][-1]
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"]
    assert last["id"] == second_id
    assert await source_of(answer) == last["content"]


async def test_thumbs_rate_an_answer_and_the_rating_is_stored_and_shown_after_a_reload(product_stack, context):
    page = await signed_in_page(context, product_stack.url)
    await send(page, "Name an animal.")
    answer = answers(page).last
    await expect(answer).to_have_attribute("data-status", "complete", timeout=REPLY_TIMEOUT_MS)
    await expect(page.locator('.message[data-role="user"] .rating')).to_have_count(0)
    await answer.locator(".rate-up").click()
    await expect(answer.locator(".rate-up")).to_have_attribute("aria-pressed", "true")
    await answer.locator(".rate-down").click()  # a second rating replaces the first
    await expect(answer.locator(".rate-down")).to_have_attribute("aria-pressed", "true")
    await expect(answer.locator(".rate-up")).to_have_attribute("aria-pressed", "false")

    conversation = await stored(product_stack.url, conversation_id_of(page))
    assert conversation["messages"][-1]["feedback"]["rating"] == "down"
    await page.reload()
    await expect(answers(page).last.locator(".rate-down")).to_have_attribute("aria-pressed", "true")
    await expect(answers(page).last.locator(".rate-up")).to_have_attribute("aria-pressed", "false")


async def test_network_drop_mid_reply_resumes_without_repeating_a_word(product_stack, context):
    page = await signed_in_page(context, product_stack.url)
    resumed_from = []
    page.on(
        "request",
        lambda request: resumed_from.append(int(request.headers.get("last-event-id", "0"))) if request.url.endswith("/stream") else None,
    )
    await send_long(page)
    answer = answers(page).last
    await wait_for_first_words(page, answer)

    await context.set_offline(True)
    await expect(answer).to_have_attribute("data-connection", "lost", timeout=10_000)
    await context.set_offline(False)

    await expect(answer).to_have_attribute("data-status", "complete", timeout=REPLY_TIMEOUT_MS)
    assert await answer.get_attribute("data-connection") is None
    assert resumed_from and max(resumed_from) >= 2, f"no resume after a delta: Last-Event-IDs {resumed_from}"
    conversation = await stored(product_stack.url, conversation_id_of(page))
    last = conversation["messages"][-1]
    assert await source_of(answer) == last["content"]


async def test_a_connection_cut_mid_reply_resumes_on_another_chat_instance(product_stack, context, proxy):
    page = await signed_in_page(context, proxy.url)
    resumed_from = []
    page.on(
        "request",
        lambda request: resumed_from.append(int(request.headers.get("last-event-id", "0"))) if request.url.endswith("/stream") else None,
    )
    await send_long(page)
    answer = answers(page).last
    await wait_for_first_words(page, answer)

    proxy.upstream = product_stack.chat_urls[1]
    assert proxy.cut() > 0
    await expect(answer).to_have_attribute("data-connection", "lost", timeout=10_000)

    await expect(answer).to_have_attribute("data-status", "complete", timeout=REPLY_TIMEOUT_MS)
    assert resumed_from and max(resumed_from) >= 2, f"no resume after a delta: Last-Event-IDs {resumed_from}"
    conversation = await stored(product_stack.url, conversation_id_of(page))
    assert await source_of(answer) == conversation["messages"][-1]["content"]


async def test_reload_mid_reply_attaches_to_the_running_reply(product_stack, context):
    page = await signed_in_page(context, product_stack.url)
    await send_long(page)
    await wait_for_first_words(page, answers(page).last)

    async def streamed_in_steps():  # the running text seen at two lengths at least, not in one late block
        growth = await page.evaluate("window.__growth")
        return growth if len(growth) >= 2 else None

    await wait_until(streamed_in_steps, timeout_s=REPLY_TIMEOUT_MS / 1000)
    attached_from = []
    page.on(
        "request",
        lambda request: attached_from.append(request.headers.get("last-event-id")) if request.url.endswith("/stream") else None,
    )
    await page.reload()

    answer = answers(page).last
    await expect(answer).to_have_attribute("data-status", "complete", timeout=REPLY_TIMEOUT_MS)
    conversation = await stored(product_stack.url, conversation_id_of(page))
    assert conversation["messages"][-1]["status"] == "complete"
    assert await source_of(answer) == conversation["messages"][-1]["content"]
    assert attached_from[:1] == ["0"], f"the page did not attach to the running reply: {attached_from}"


async def test_a_refused_send_shows_why_and_gives_the_text_back(product_stack, context):
    page = await signed_in_page(context, product_stack.url)
    too_long = "x" * 32_001
    await send(page, too_long)

    banner = page.locator("#banner")
    await expect(banner).to_be_visible()
    await expect(banner).to_contain_text("Too long to send: the message has 32001 characters; at most 32000 are accepted.")
    await expect(banner).to_contain_text("Shorten it and send it again.")
    assert await page.eval_on_selector("#input", "el => el.value.length") == len(too_long)
    await expect(page.locator(".message")).to_have_count(0)


@pytest_asyncio.fixture
async def chat_without_workers(product_stack, tmp_path):
    """A chat instance on a bus of its own where no worker runs: every send is refused with 503."""
    bus = start_nats(tmp_path)
    init_token_stream(bus)
    env = service_env(
        "chat", bus.url, product_stack.redis_url, TANDEM_STORE="sqlite", TANDEM_SQLITE_PATH=str(tmp_path / "c.db"), TANDEM_API_KEYS=API_KEYS
    )
    chat = service_process("chat", env)
    chat.start()
    nc = await nats.connect(bus.url)
    try:
        await next_heartbeat(nc, "chat", env["TANDEM_INSTANCE_ID"], accept=lambda hb: hb.is_ready, timeout_s=120)
        yield f"http://127.0.0.1:{env['TANDEM_HTTP_PORT']}"
    finally:
        await nc.close()
        chat.stop(timeout_s=10)
        bus.stop()


async def test_a_send_refused_as_unavailable_says_so_with_the_time_to_retry(chat_without_workers, context):
    page = await signed_in_page(context, chat_without_workers)
    await send(page, "Is anyone there?")

    banner = page.locator("#banner")
    await expect(banner).to_contain_text("Unavailable right now: no model is being served yet.", timeout=30_000)
    await expect(banner).to_contain_text(re.compile(r"Try again in \d+ seconds?\."))
    await expect(page.locator("#send")).to_have_text(re.compile(r"Wait \d+ s"))
    await expect(banner).to_contain_text("You can try again now.", timeout=15_000)  # the countdown ends
    await expect(page.locator("#send")).to_have_text("Send")
    await expect(page.locator("#input")).to_have_value("Is anyone there?")  # given back: nothing was stored


async def test_on_a_phone_the_sidebar_slides_in_and_the_reply_stays_in_view(product_stack, context):
    page = await signed_in_page(context, product_stack.url)
    await page.set_viewport_size({"width": 390, "height": 420})
    await expect(page.locator("#sidebar")).not_to_be_in_viewport()
    # A question taller than the screen: only following the reply keeps its end in view.
    await send(page, LONG_PROMPT + "\n" * 14 + "Thank you!")
    answer = answers(page).last
    await expect(answer).not_to_have_attribute("data-status", "running", timeout=REPLY_TIMEOUT_MS)

    scroll = await page.eval_on_selector("#messages", "m => [m.scrollTop, m.clientHeight, m.scrollHeight]")
    top, visible, total = scroll
    assert total > visible, f"the conversation fits the screen, so scrolling was not tested: {scroll}"
    assert top + visible >= total - 2, f"the message list did not follow the reply: {scroll}"

    await page.click("#toggle-sidebar")
    await expect(page.locator("#sidebar")).to_be_in_viewport()
    await page.click(f'#conversations a[data-id="{conversation_id_of(page)}"]')
    await expect(page.locator("#sidebar")).not_to_be_in_viewport()


# An answer as a model might write it, Markdown with script smuggled in every way it could be.
HOSTILE_MARKDOWN = """# Plan

Some **bold**, `inline code`, a [safe link](https://example.com/docs) and a [bad one](javascript:window.__pwned='link').
A second line of the same paragraph.

| step | cost |
|------|------|
| one  | 1    |

- first
- second

```python
def add(a, b):
    return a + b
```

<img src=x onerror="window.__pwned='img'">

<script>window.__pwned = 'script'</script>

Inline <img src=x onerror=window.__pwned='inline'> and ![a picture](https://example.com/x.png) too.
"""


async def stored_answer(store_path, content: str) -> str:
    """A conversation of Alice's whose answer is `content`, written to the stack's own store: the
    model's output is not the test's to choose, so the page is given this text as stored."""
    store = SqliteStore(store_path)
    await store.start()
    try:
        conversation_id = uuid.uuid4().hex
        now = now_ms()
        await store.create_conversation(Conversation(conversation_id, "alice", "markdown", "auto", now, now))
        question = await store.append_message("alice", NewMessage(uuid.uuid4().hex, conversation_id, Role.USER, "Plan it.", 3))
        answer = NewMessage(uuid.uuid4().hex, conversation_id, Role.ASSISTANT, content, 80, parent_seq=question.seq)
        await store.append_message("alice", answer)
    finally:
        await store.close()
    return conversation_id


async def test_answers_render_markdown_with_highlighted_code_and_never_run_script(product_stack, context):
    conversation_id = await stored_answer(product_stack.store_path, HOSTILE_MARKDOWN)
    page = await signed_in_page(context, product_stack.url)
    await page.goto(f"{product_stack.url}/#{conversation_id}")
    answer = answers(page).last
    await expect(answer).to_have_attribute("data-source", HOSTILE_MARKDOWN)
    response = await page.request.get(f"{product_stack.url}/")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    content = answer.locator(".content")

    await expect(content.locator("h1")).to_have_text("Plan")
    await expect(content.locator("strong")).to_have_text("bold")
    await expect(content.locator("p", has=page.locator("strong")).locator("br")).to_have_count(1)  # line breaks kept
    await expect(content.locator("p > code")).to_have_text("inline code")
    await expect(content.locator("li")).to_have_count(2)
    await expect(content.locator("td")).to_have_text(["one", "1"])
    safe = content.locator('a[href="https://example.com/docs"]')
    await expect(safe).to_have_attribute("rel", "noopener noreferrer nofollow")
    await expect(safe).to_have_attribute("target", "_blank")
    code = content.locator(".code-block pre code.hljs")
    await expect(code).to_have_text("def add(a, b):\n    return a + b")
    await expect(code.locator(".hljs-keyword").first).to_have_text("def")
    await expect(content.locator(".code-block .copy-code")).to_have_text("Copy")
    # The smuggled markup is shown as the text it is; images become links, nothing is fetched.
    await expect(content).to_contain_text("<img src=x onerror=\"window.__pwned='img'\">")
    await expect(content).to_contain_text("<script>window.__pwned = 'script'</script>")
    await expect(content.locator('a[href="https://example.com/x.png"]')).to_have_text("a picture")
    assert await page.locator("#messages img, #messages script, #messages [onerror]").count() == 0
    assert await content.locator('a[href^="javascript"]').count() == 0

    # While streaming, every prefix of the answer is rendered: none of them may run script either.
    dangerous = await page.evaluate(
        """async (source) => {
            const { renderMarkdown } = await import('/static/markdown.js');
            const target = document.createElement('div');
            document.body.append(target);
            const found = [];
            for (let end = 1; end <= source.length; end += 1) {
                renderMarkdown(target, source.slice(0, end), end === source.length);
                if (target.querySelector('img, script, [onerror], a[href^="javascript"]')) found.push(end);
            }
            target.remove();
            return found;
        }""",
        HOSTILE_MARKDOWN,
    )
    assert dangerous == [], f"script-capable markup appeared at prefix lengths {dangerous[:10]}"
    assert await page.evaluate("window.__pwned") is None, "model output ran script in the page"


async def test_a_conversation_is_renamed_found_by_search_and_deleted_from_the_sidebar(product_stack, context):
    async with httpx.AsyncClient(base_url=product_stack.url, headers=ALICE) as client:
        other_id = (await client.post("/v1/conversations", json={"title": "another chat"})).json()["id"]
        conversation_id = (await client.post("/v1/conversations", json={"title": "to rename"})).json()["id"]
    page = await signed_in_page(context, product_stack.url)
    item = page.locator(f'#conversations li[data-id="{conversation_id}"]')
    await item.locator("a").click()
    await expect(page.locator("#chat-title")).to_have_text("to rename")

    await item.hover()
    await item.locator(".rename").click()
    await page.locator(".rename-input").fill("never saved")
    await page.press(".rename-input", "Escape")
    await expect(item.locator("a")).to_have_text("to rename")
    await item.locator(".rename").click()
    await page.locator(".rename-input").fill("Renamed chat")
    await page.press(".rename-input", "Enter")
    await expect(item.locator("a")).to_have_text("Renamed chat")
    await expect(page.locator("#chat-title")).to_have_text("Renamed chat")

    async def title_stored():
        async with httpx.AsyncClient(base_url=product_stack.url, headers=ALICE) as client:
            response = await client.get(f"/v1/conversations/{conversation_id}")
        return response.json()["title"] == "Renamed chat" or None

    await wait_until(title_stored, timeout_s=10)

    other = page.locator(f'#conversations li[data-id="{other_id}"]')
    await page.fill("#search", "RENAMED c")
    await expect(item).to_be_visible()
    await expect(other).to_be_hidden()
    await page.fill("#search", "no title has this")
    await expect(item).to_be_hidden()
    await expect(page.locator("#conversations-note")).to_contain_text("matches")
    await page.fill("#search", "")
    await expect(other).to_be_visible()

    page.once("dialog", lambda dialog: dialog.accept())
    await item.locator(".delete").click()
    await expect(item).to_have_count(0)
    await expect(page.locator("#chat-title")).to_have_text("New chat")
    assert not page.url.partition("#")[2], "the page still points at the deleted conversation"

    async def gone():
        async with httpx.AsyncClient(base_url=product_stack.url, headers=ALICE) as client:
            response = await client.get(f"/v1/conversations/{conversation_id}")
        return response.status_code == 404 or None

    await wait_until(gone, timeout_s=10)


async def test_the_conversation_list_loads_more_a_page_at_a_time(product_stack, context):
    async with httpx.AsyncClient(base_url=product_stack.url, headers=ALICE) as client:
        created = [(await client.post("/v1/conversations", json={"title": f"paged {i}"})).json()["id"] for i in range(51)]
    page = await signed_in_page(context, product_stack.url)
    links = page.locator("#conversations li a")
    await expect(links).to_have_count(50)  # one page
    await expect(page.locator("#load-more")).to_be_visible()
    await page.click("#load-more")
    await expect(links.nth(50)).to_be_attached()
    shown = await links.evaluate_all("links => links.map((a) => a.dataset.id)")
    assert len(shown) == len(set(shown)), "a conversation is listed twice"
    assert set(created) <= set(shown), "a conversation of the first two pages is missing"


async def test_esc_stops_the_reply_and_a_shortcut_starts_a_new_chat(product_stack, context):
    page = await signed_in_page(context, product_stack.url)
    await send_long(page)
    answer = answers(page).last
    await wait_for_first_words(page, answer)
    await page.press("#input", "Escape")
    await expect(answer).to_have_attribute("data-status", "stopped", timeout=REPLY_TIMEOUT_MS)
    conversation = await stored(product_stack.url, conversation_id_of(page))
    assert conversation["messages"][-1]["status"] == "stopped"

    await page.keyboard.press("Control+Shift+O")
    await expect(page.locator(".message")).to_have_count(0)
    await expect(page.locator("#chat-title")).to_have_text("New chat")
    assert not page.url.partition("#")[2], "the new chat still points at the old conversation"


async def test_the_theme_toggle_switches_light_and_dark_and_is_remembered(product_stack, context):
    page = await signed_in_page(context, product_stack.url)
    html = page.locator("html")
    background = "() => getComputedStyle(document.body).backgroundColor"
    await expect(page.locator("#theme")).to_have_text("Theme: auto")
    await page.click("#theme")
    await expect(html).to_have_attribute("data-theme", "light")
    assert await page.evaluate(background) == "rgb(255, 255, 255)"
    await page.click("#theme")
    await expect(html).to_have_attribute("data-theme", "dark")
    assert await page.evaluate(background) == "rgb(23, 24, 27)"
    assert await page.eval_on_selector("#code-theme-dark", "link => link.media") == "all"

    await page.reload()
    await expect(page.locator("#theme")).to_have_text("Theme: dark")
    await expect(html).to_have_attribute("data-theme", "dark")
    await page.click("#theme")
    await expect(html).not_to_have_attribute("data-theme", "dark")
    await expect(page.locator("#theme")).to_have_text("Theme: auto")


async def test_versions_switch_between_regenerated_answers_and_an_edit_branches(product_stack, context):
    page = await signed_in_page(context, product_stack.url)
    await send(page, "Name a colour.")
    first = answers(page).last
    await expect(first).to_have_attribute("data-status", "complete", timeout=REPLY_TIMEOUT_MS)
    await send(page, "Name a fruit.")
    await expect(answers(page)).to_have_count(2)
    await expect(answers(page).last).to_have_attribute("data-status", "complete", timeout=REPLY_TIMEOUT_MS)
    fruit_answer = await source_of(answers(page).last)
    first_id = await answers(page).first.get_attribute("data-id")
    users = page.locator('.message[data-role="user"]')
    await expect(users.last.locator(".edit")).to_be_visible()  # the sent message got its id

    # Regenerate the last answer: it shows 2/2, and the previous-version button goes back to the first one.
    last = answers(page).last
    await last.locator(".regenerate").click()
    await expect(last).to_have_attribute("data-status", "complete", timeout=REPLY_TIMEOUT_MS)
    await expect(last.locator(".version-count")).to_have_text("2/2")
    regenerated = await source_of(last)
    await last.locator(".version-prev").click()
    await expect(answers(page).last.locator(".version-count")).to_have_text("1/2")
    await expect(answers(page).last).to_have_attribute("data-source", fruit_answer)
    await answers(page).last.locator(".version-next").click()
    await expect(answers(page).last).to_have_attribute("data-source", regenerated)

    # Edit the second question: it and its answers make way for the new version.
    await users.last.locator(".edit").click()
    await page.fill(".edit-input", "Name a vegetable.")
    await page.press(".edit-input", "Enter")
    await expect(users.last.locator(".content")).to_have_text("Name a vegetable.")
    await expect(answers(page).last).to_have_attribute("data-status", "complete", timeout=REPLY_TIMEOUT_MS)
    await expect(page.locator(".message")).to_have_count(4)
    await expect(users.last.locator(".version-count")).to_have_text("2/2")
    conversation = await stored(product_stack.url, conversation_id_of(page))
    assert [m["content"] for m in conversation["messages"] if m["role"] == "user"] == ["Name a colour.", "Name a vegetable."]
    assert len(conversation["tree"]) == 7  # two questions, the edit, and four answers

    # The older version of the question brings back its own answers, the regenerated one last shown.
    await users.last.locator(".version-prev").click()
    await expect(users.last.locator(".content")).to_have_text("Name a fruit.")
    await expect(answers(page).last).to_have_attribute("data-source", regenerated)
    await expect(answers(page).last.locator(".version-count")).to_have_text("2/2")
    await expect(answers(page).first).to_have_attribute("data-id", first_id)

    # A reload shows the branch written last: the edited one.
    await page.reload()
    await expect(users.last.locator(".content")).to_have_text("Name a vegetable.")
    await expect(users.last.locator(".version-count")).to_have_text("2/2")


async def summarised_conversation(store_path, summary: str) -> str:
    """A conversation of Alice's of two exchanges whose first one (seqs 1 and 2) its summary covers,
    written to the stack's own store as a summary job would leave it."""
    store = SqliteStore(store_path)
    await store.start()
    try:
        conversation_id = uuid.uuid4().hex
        now = now_ms()
        await store.create_conversation(Conversation(conversation_id, "alice", "summarised", "auto", now, now))
        parent = 0
        for role, content in ((Role.USER, "I am Ada."), (Role.ASSISTANT, "Hello Ada."), (Role.USER, "Who am I?"), (Role.ASSISTANT, "Ada.")):
            message = await store.append_message(
                "alice", NewMessage(uuid.uuid4().hex, conversation_id, role, content, 4, parent_seq=parent)
            )
            parent = message.seq
        await store.update_conversation("alice", conversation_id, summary=summary, summary_upto_seq=2)
    finally:
        await store.close()
    return conversation_id


async def test_a_summarised_conversation_shows_a_note_above_the_first_message_after_the_summary(product_stack, context):
    summary = "The user introduced herself as Ada; <b>the assistant</b> greeted her."
    conversation_id = await summarised_conversation(product_stack.store_path, summary)
    page = await signed_in_page(context, product_stack.url)
    await page.goto(f"{product_stack.url}/#{conversation_id}")
    await expect(page.locator(".message")).to_have_count(4)
    note = page.locator("#messages .summary-note")
    await expect(note).to_have_count(1)
    await expect(note.locator("summary")).to_have_text("Earlier messages are summarised")
    # Right above the third message, the first the summary does not cover.
    after_note = note.locator("xpath=following-sibling::*[1]")
    await expect(after_note.locator(".content")).to_have_text("Who am I?")
    await expect(note.locator("p")).to_be_hidden()
    await note.locator("summary").click()
    await expect(note.locator("p")).to_have_text(summary)  # model output, shown as text
    assert await page.locator("#messages b").count() == 0

    # Another conversation (no summary) shows no note.
    await page.click("#new-chat")
    await send(page, "Hi")
    await expect(answers(page).last).to_have_attribute("data-status", "complete", timeout=REPLY_TIMEOUT_MS)
    await expect(page.locator("#messages .summary-note")).to_have_count(0)
