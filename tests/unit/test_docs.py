"""The docs site: the generated pages' renderers (docs/hooks/) on the real Settings and the real
chat app, and `mkdocs build --strict`, which fails on a broken link, anchor or page."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tandem.config import Settings

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / "docs" / "hooks"


def hook_module(name: str) -> ModuleType:
    """A module of docs/hooks, imported as mkdocs imports it (its folder on sys.path)."""
    if str(HOOKS) not in sys.path:
        sys.path.insert(0, str(HOOKS))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def chat_openapi() -> dict:
    return hook_module("generated_pages").chat_openapi()


@pytest.fixture(scope="module")
def api_page(chat_openapi) -> str:
    return hook_module("openapi_page").render_openapi(chat_openapi)


def test_every_setting_falls_in_exactly_one_section_in_the_class_order():
    sections = hook_module("settings_page").sections(Settings)
    listed = [name for _, _, names in sections for name in names]
    assert listed == list(Settings.model_fields)
    titles = [title for title, _, _ in sections]
    assert titles[:3] == ["Processes, the model and the engine", "A worker's engine batch", "Conversation store (chat and relay)"]
    assert not any("issue" in title for title in titles), "the issue numbers in the section comments are for developers"


def test_setting_types_say_what_a_reader_writes():
    page = hook_module("settings_page")
    fields = Settings.model_fields
    assert page.describe_type(fields["log_level"]) == "one of `debug`, `info`, `warning`, `error`"
    assert page.describe_type(fields["kv_cache_mib"]) == "integer, optional (≥ 1)"
    assert page.describe_type(fields["decode_workers"]) == "integer (≥ 1, ≤ 16)"
    assert page.describe_type(fields["api_keys"]) == "string"  # parsed from key=user:tier text
    assert page.describe_type(fields["nats_password"]) == "secret string"
    assert page.describe_type(fields["model_path"]) == "path, optional"
    assert page.describe_default(fields["enforce_eager"]) == "`false`"
    assert page.describe_default(fields["nats_password"]) == "empty"
    assert page.describe_default(fields["http_port"]) == "unset"


def test_docstring_text_keeps_code_spans_and_escapes_the_rest():
    escape = hook_module("markdown_text").escape
    assert escape("empty: <role>-<pid>") == "empty: &lt;role&gt;-&lt;pid&gt;"
    assert escape("blocklist:word|word, or `a|b`") == "blocklist:word\\|word, or `a|b`"
    assert escape("kv_cache_mib\n   decides") == "kv\\_cache\\_mib decides"


def test_the_api_page_has_every_operation_of_the_chat_schema(chat_openapi, api_page):
    operation_id = hook_module("openapi_page").operation_id
    operations = [(method, path) for path, item in chat_openapi["paths"].items() for method in item]
    assert ("post", "/v1/chat/completions") in operations
    assert ("post", "/v1/conversations/{conversation_id}/messages") in operations
    for method, path in operations:
        heading = f"### `{method.upper()} {path}` {{#{operation_id(method, path)}}}"
        assert api_page.count(heading) == 1, f"{heading} is not on the page once"


def test_the_api_page_describes_every_body_schema_and_links_to_present_ones(chat_openapi, api_page):
    schema_ids = set(re.findall(r"^### \w+ \{#(schema-[\w-]+)\}$", api_page, re.MULTILINE))
    assert len(schema_ids) == len(chat_openapi["components"]["schemas"])
    linked = set(re.findall(r"\]\(#(schema-[\w-]+)\)", api_page))
    assert "schema-chatcompletionbody" in linked
    assert linked <= schema_ids


def test_a_request_body_lists_its_fields_with_type_and_bounds(api_page):
    body = api_page.split("{#schema-chatcompletionbody}", 1)[1].split("\n### ", 1)[0]
    assert "| `messages` | array of [ChatMessage](#schema-chatmessage) (items ≥ 1, items ≤ 1000) | yes |" in body
    assert "| `temperature` | number (≥ 0, ≤ 2) or null | no |" in body
    assert "| `stream` | boolean | no | `false` |" in body


def test_the_site_builds_with_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed: `make test` installs the docs extra (pip install -e '.[docs]')")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    settings_html = (site / "reference" / "settings" / "index.html").read_text()
    assert "TANDEM_KV_CACHE_MIB" in settings_html, "the settings page was not generated"
    assert 'id="post-v1-chat-completions"' in (site / "api" / "reference" / "index.html").read_text()
    assert not (site / "hooks").exists(), "the hooks' source is not part of the site"
