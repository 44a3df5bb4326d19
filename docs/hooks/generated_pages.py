"""mkdocs hook: the pages generated from the code. docs/reference/settings.md and
docs/api/reference.md are placeholders in the repository; each build replaces their Markdown with
what the Settings class and the chat's OpenAPI schema say now, so neither can go stale."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from openapi_page import render_openapi
from settings_page import render_settings

from tandem.config import ApiKey, Settings, Tier

API_INTRO = (
    "Every endpoint of the chat service, generated from its OpenAPI schema when the site is built; "
    "a running chat serves the same schema at `/openapi.json`. "
    "[Using the API](index.md) explains authentication, streaming and errors, "
    "[OpenAI-compatible](openai.md) the `/v1/chat/completions` and `/v1/completions` endpoints."
)


def chat_openapi() -> dict[str, Any]:
    """The chat app's schema. Building the app connects to nothing (its lifespan does, and
    openapi() does not run it); no moderation or classifier process is started for it."""
    from services.chat.app import build_app  # imported here: mkdocs loads this hook for every command

    settings = Settings.model_construct(
        api_keys={"docs": ApiKey(user_id="docs", tier=Tier.FREE)},  # no warning about an empty key list
        input_moderation="none",
        difficulty_classifier="none",
    )
    return build_app(settings).openapi()


def settings_markdown() -> str:
    return render_settings(Settings)


def api_markdown() -> str:
    return render_openapi(chat_openapi(), intro=API_INTRO)


GENERATED: dict[str, Callable[[], str]] = {
    "reference/settings.md": settings_markdown,
    "api/reference.md": api_markdown,
}


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    render = GENERATED.get(page.file.src_uri)
    return render() if render is not None else markdown
