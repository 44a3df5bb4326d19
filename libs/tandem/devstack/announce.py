"""What `tandem up` says once every member is ready: where the chat answers, the API keys, the
models, where each worker computes, the ops ports, and how tools reach the bus. Every port but the
chat's is a free one, so this is the one place a user learns them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tandem.devstack.members import Member, StackConfig
from tandem.tls import TlsSettings


def ready_lines(
    config: StackConfig, members: Sequence[Member], chat_url: str, nats_url: str, operator_tls: TlsSettings | None, operator_file: Path
) -> list[str]:
    """The lines, in order; `chat_url` is the first chat instance's as a user reaches it."""
    lines = [f"Tandem is up at {chat_url}"]
    chats = [m for m in members if m.role == "chat"]
    if len(chats) > 1:
        lines += [f"{chat.name} at {chat.url}" for chat in chats]
    lines += [f"API key: {key}  (user {api_key.user_id}, tier {api_key.tier.value})" for key, api_key in config.api_keys.items()]
    env = config.extra_env
    if "TANDEM_SMALL_MODEL" in env:
        small = f"{config.num_small_decode_workers} small-decode worker(s)"
        lines.append(f'models: {env["TANDEM_LARGE_MODEL"]} (large), {env["TANDEM_SMALL_MODEL"]} (small, {small}); "auto" picks one')
    if config.tensor_parallel_size > 1:
        lines.append(f"the large model's prefill and decode workers: {config.tensor_parallel_size} tensor-parallel ranks each")
    gpus = config.visible_gpus()
    lines += [f"{m.name} computes on GPUs {gpus[m.instance_id]} (its CUDA_VISIBLE_DEVICES)" for m in members if m.instance_id in gpus]
    services = [m for m in members if m.ops_url]
    if services:
        lines.append("ops ports (/healthz /readyz /metrics /docs): " + ", ".join(f"{m.name} {m.ops_url}" for m in services))
    if chats:
        lines.append(f"try: curl -s {chats[0].ops_url}/readyz")
    routers = [m for m in members if m.role == "router"]
    if routers and chats:
        lines.append(f"watch: tandem top --router-url {routers[0].url} --router-ops-url {routers[0].ops_url} --chat-url {chats[0].ops_url}")
    tls = "".join(f"{name}={value} " for name, value in operator_tls.env().items()) if operator_tls else ""
    lines.append(f'internal clients: TANDEM_NATS_URL={nats_url} {tls}tandem generate --via-bus "Hello"')
    lines.append(f"  (the operator's login, made for this run; as settings in {operator_file})")
    lines.append("Ctrl-C stops everything")
    return lines
