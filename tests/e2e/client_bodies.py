"""The request bodies two chat front-ends send to an OpenAI-compatible server, as the compatibility
suite (test_client_compat.py) replays them.

Their fields and shapes were read from the front-ends' released code (Open WebUI 0.12.4's wheel on
PyPI: `routers/openai.py`, `utils/middleware.py`, `routers/tasks.py`, `tools/builtin.py`; LibreChat
through `@librechat/agents` 3.9.2 and `@langchain/openai` 1.6 on npm, `api/server/controllers/agents/
client.js`). What reaches the server:

- Open WebUI, a chat turn: `stream`, `model`, `messages`, and in its default (native) function
  calling its built-in tools as `tools`, with no `tool_choice`; `stream_options` only for a model
  whose "usage" capability is ticked. Its UI fields (`metadata`, `params`, `chat_id`, ...) are
  removed before the request leaves it. In its legacy function calling there is no `tools`.
- Open WebUI, its background tasks: one user message holding a task prompt with the chat
  history in it, `stream: false`; the title with `max_tokens: 1000`, follow-ups and tags with no
  limit at all. Each asks for a JSON object back.
- LibreChat, a chat turn: `model`, `user` (the account's id, a string), `stream: true`,
  `stream_options: {"include_usage": true}`, `messages`; its older releases also sent
  `temperature: 1, top_p: 1, presence_penalty: 0, frequency_penalty: 0, n: 1` every time.
- LibreChat, a title: one user message holding the conversation, `stream: false`, no limit.

The task prompts below are written for these tests in the shape the front-ends use (a task,
guidelines, the JSON wanted, the chat history); their wording is not the front-ends' own. The
tools are Open WebUI's built-in ones as a plain chat sends them (names and parameter shapes:
defaults, optional parameters, an object array with `additionalProperties: true`), with
descriptions of our own."""

from __future__ import annotations

from typing import Any

QUESTION = "What is the capital of France?"
ANSWER = "Paris."
FOLLOW_UP = "And of Germany?"
LIBRECHAT_USER = "665f1c2ab3e4d5f6a7b8c9d0"  # a MongoDB ObjectId, as LibreChat's user ids are


def _history(answer: str) -> str:
    return f"<chat_history>\nUSER: {QUESTION}\nASSISTANT: {answer}\n</chat_history>"


def _task(task: str, output: str, answer: str) -> str:
    guidelines = "\n".join(
        f"- {line}"
        for line in (
            "Base it on the conversation below only.",
            "Write in the language the user writes in.",
            "Answer with the JSON object alone: no code fences, no text around it.",
        )
    )
    return f"### Task:\n{task}\n### Guidelines:\n{guidelines}\n### Output:\nJSON format: {output}\n### Chat History:\n{_history(answer)}"


def _integer(what: str, default: int) -> dict[str, Any]:
    return {"default": default, "description": f"{what} (default: {default})", "type": "integer"}


def _string(what: str) -> dict[str, Any]:
    return {"description": what, "type": "string"}


def _tool(name: str, description: str, properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    parameters: dict[str, Any] = {"properties": properties, "type": "object"}
    if required:
        parameters["required"] = list(required)
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _search(name: str, what: str, **more: Any) -> dict[str, Any]:
    properties = {"query": _string(f"What to look for among the {what}"), "count": _integer("How many results at most", 5), **more}
    return _tool(name, f"Search the user's {what}.", properties, ("query",))


OPEN_WEBUI_TOOLS = [
    _tool("get_current_timestamp", "The time now, as Unix seconds.", {}),
    _tool(
        "calculate_timestamp",
        "The time some days, weeks, months or years ago, as Unix seconds.",
        {f"{unit}_ago": _integer(f"{unit.capitalize()} back from now", 0) for unit in ("days", "weeks", "months", "years")},
    ),
    _tool(
        "ask_user",
        "Ask the user one to three questions, each with a few options to pick from.",
        {"questions": {"description": "The questions", "items": {"additionalProperties": True, "type": "object"}, "type": "array"}},
        ("questions",),
    ),
    _tool(
        "list_knowledge_bases",
        "List the knowledge bases the user can read.",
        {"count": _integer("How many", 10), "skip": _integer("How many to skip", 0)},
    ),
    _search("search_knowledge_bases", "knowledge bases", skip=_integer("How many to skip", 0)),
    _search("query_knowledge_bases", "knowledge bases' contents"),
    _tool(
        "grep_knowledge_files",
        "Find a text pattern in the knowledge files.",
        {
            "pattern": _string("The pattern"),
            "file_id": _string("One file to look in"),
            "case_insensitive": {"default": False, "type": "boolean"},
        },
        ("pattern",),
    ),
    _search("search_knowledge_files", "knowledge files by name", knowledge_id=_string("One knowledge base to look in")),
    _search("query_knowledge_files", "knowledge files' contents", knowledge_ids={"items": {"type": "string"}, "type": "array"}),
    _tool(
        "view_knowledge_file",
        "Read a knowledge file.",
        {"file_id": _string("The file"), "offset": _integer("Where to start, in characters", 0), "max_chars": {"type": "integer"}},
        ("file_id",),
    ),
    _search("search_chats", "earlier chats", start_timestamp={"type": "integer"}, end_timestamp={"type": "integer"}),
    _tool("view_chat", "Read an earlier chat.", {"chat_id": _string("The chat")}, ("chat_id",)),
    _search("search_notes", "notes", start_timestamp={"type": "integer"}, end_timestamp={"type": "integer"}),
    _tool("view_note", "Read a note.", {"note_id": _string("The note")}, ("note_id",)),
    _tool("write_note", "Write a new note.", {"title": _string("Its title"), "content": _string("Its markdown")}, ("title", "content")),
    _tool(
        "replace_note_content",
        "Change a note.",
        {
            "note_id": _string("The note"),
            "content": _string("The whole new markdown"),
            "operations": {"items": {"additionalProperties": True, "type": "object"}, "type": "array"},
        },
        ("note_id",),
    ),
    _tool("create_tasks", "Keep a task list for this chat.", {"tasks": {"items": {"type": "string"}, "type": "array"}}, ("tasks",)),
    _tool(
        "update_task",
        "Change a task's status.",
        {"id": _string("The task"), "status": {"default": "completed", "type": "string"}},
        ("id",),
    ),
]


def open_webui_turn(model: str, *, native_tools: bool) -> dict[str, Any]:
    """A first chat turn from Open WebUI's page, its function calling native (the default: its
    built-in tools go along) or legacy (none)."""
    body: dict[str, Any] = {"stream": True, "model": model, "messages": [{"role": "user", "content": QUESTION}]}
    if native_tools:
        body["tools"] = OPEN_WEBUI_TOOLS
    return body


def open_webui_title(model: str) -> dict[str, Any]:
    """Started with the first reply, so the assistant's line is still empty."""
    prompt = _task("Give the chat a short title.", '{ "title": "the title" }', "")
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": False, "max_tokens": 1000}


def open_webui_follow_ups(model: str) -> dict[str, Any]:
    prompt = _task("Suggest three messages the user might send next.", '{ "follow_ups": ["first", "second", "third"] }', ANSWER)
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": False}


def open_webui_tags(model: str) -> dict[str, Any]:
    prompt = _task("Tag the chat with one to three broad topics.", '{ "tags": ["tag1", "tag2"] }', ANSWER)
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": False}


def librechat_turn(model: str, *, follow_up: bool = False, older: bool = False) -> dict[str, Any]:
    """A streamed turn; `follow_up` the second one, the first answer in the history; `older` as
    releases before LangChain 1.x sent it, every sampling parameter at its default."""
    messages = [{"role": "user", "content": QUESTION}]
    if follow_up:
        messages += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": FOLLOW_UP}]
    body: dict[str, Any] = {
        "model": model,
        "user": LIBRECHAT_USER,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": messages,
    }
    if older:
        body.update(temperature=1, top_p=1, presence_penalty=0, frequency_penalty=0, n=1)
    return body


def librechat_title(model: str) -> dict[str, Any]:
    prompt = f"Give this conversation a title of five words at most, in title case, and nothing else.\n\nConversation:\nUser: {QUESTION}\nAI: {ANSWER}"
    return {"model": model, "user": LIBRECHAT_USER, "stream": False, "messages": [{"role": "user", "content": prompt}]}
