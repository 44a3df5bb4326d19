"""What `tandem up`'s settings make of the stack: its StackConfig, the environment every service
gets, and the served names of the two models it runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.bus.token_stream import TokenStreamConfig
from tandem.config import Settings
from tandem.devstack.devices import host_gpus
from tandem.devstack.members import HA_NATS_NODES, StackConfig, dev_api_keys
from tandem.errors import StartupError
from tandem.models.files import EMBEDDED_MODEL_NAME, open_model
from tandem.ops.store_migrate import StoreAdmin

# Settings the stack sets for each service itself; any other setting given to `tandem up` as a
# flag reaches every service as its variable.
_STACK_OWNED_SETTINGS = frozenset(
    {
        "host",
        "http_port",
        "grpc_port",
        "ucx_port",
        "instance_id",
        "nats_url",
        "redis_url",
        "api_keys",
        "decode_workers",
        "prefill_workers",
        "chat_instances",
        "nats_user",
        "nats_password",
        "redis_username",
        "redis_password",
        "internal_secret",
        "small_decode_workers",
        "small_model_path",
        "small_model_quantization",
        "large_model",
        "small_model",
        "tensor_parallel_size",  # the small model's workers run one rank
        "token_stream_replicas",  # the stack's `tandem bus init`'s, not the services'
        "token_stream_max_bytes",
        "token_stream_max_age_s",
    }
)


def stack_config_from(settings: Settings, chat_port: int | None, flags: dict[str, str] | None = None, is_ha: bool = False) -> StackConfig:
    """`flags`: the settings given to `tandem up` as flags (name -> value as typed); each reaches
    every service as its TANDEM_ variable, except those the stack sets per member. On a host with
    GPUs (unless TANDEM_DEVICE is cpu) each worker rank gets one of its own: NotEnoughGpus here,
    before anything starts, when there are too few. `is_ha` (tandem up --ha): a NATS cluster and
    the token stream on HA_NATS_NODES replicas unless TANDEM_TOKEN_STREAM_REPLICAS says otherwise."""
    extra_env: dict[str, str] = {"TANDEM_LOG_LEVEL": settings.log_level}
    if settings.model_path is not None:
        extra_env["TANDEM_MODEL_PATH"] = str(settings.model_path)
    for name, value in (flags or {}).items():
        if name not in _STACK_OWNED_SETTINGS:
            extra_env[f"TANDEM_{name.upper()}"] = str(value)
    small_worker_env: dict[str, str] = {}
    if settings.small_decode_workers:
        pools = model_pools(settings)
        extra_env.update({"TANDEM_LARGE_MODEL": pools.large, "TANDEM_SMALL_MODEL": pools.small})
        small_worker_env = {"TANDEM_QUANTIZATION": settings.small_model_quantization, "TANDEM_SERVED_MODEL_NAME": pools.small}
        small_path = settings.small_model_path or settings.model_path
        if small_path is not None:
            small_worker_env["TANDEM_MODEL_PATH"] = str(small_path)
    config = StackConfig(
        host=settings.host,
        chat_port=settings.http_port_for("chat") if chat_port is None else chat_port,
        api_keys=settings.api_keys or dev_api_keys(),
        extra_env=extra_env,
        num_decode_workers=settings.decode_workers,
        num_prefill_workers=settings.prefill_workers,
        num_chat_instances=settings.chat_instances,
        num_small_decode_workers=settings.small_decode_workers,
        small_worker_env=small_worker_env,
        tensor_parallel_size=settings.tensor_parallel_size,
        store_admin=StoreAdmin.from_settings(settings),
        gpus=_worker_gpus(settings.device),
        ha=is_ha,
        token_stream=token_stream_of(settings, is_ha),
    )
    config.visible_gpus()  # fails now, not in each worker, when the host has too few GPUs
    return config


def token_stream_of(settings: Settings, is_ha: bool) -> TokenStreamConfig:
    """The token stream the stack's `tandem bus init` makes: on every node of an HA stack's
    cluster unless the replicas are set."""
    is_set = "token_stream_replicas" in settings.model_fields_set
    return TokenStreamConfig(
        num_replicas=HA_NATS_NODES if is_ha and not is_set else settings.token_stream_replicas,
        max_bytes=settings.token_stream_max_bytes,
        max_age_s=settings.token_stream_max_age_s,
    )


def _worker_gpus(device: str) -> tuple[str, ...]:
    gpus = host_gpus(device)
    if device == "cuda" and not gpus:
        raise StartupError("TANDEM_DEVICE=cuda (or --device cuda), but torch sees no CUDA GPU here: use cpu or auto")
    return gpus


@dataclass(frozen=True)
class ModelNames:
    large: str
    small: str


def model_pools(settings: Settings) -> ModelNames:
    """The served ids of the two models `tandem up` serves: large_model and small_model when set,
    else named as a worker names its model (tandem.models.files): the served_model_name or the
    file's, and the small one's file name with its quantization ("SmolLM2-135M-Instruct" and
    "SmolLM2-135M-Instruct-int8" by default). Raises StartupError when both would be one model."""
    large = settings.large_model or settings.served_model_name or _file_model_name(settings.model_path)
    small = settings.small_model
    if not small:
        small = large if settings.small_model_path is None else _file_model_name(settings.small_model_path)
        if settings.small_model_quantization != "none":
            small = f"{small}-{settings.small_model_quantization}"
    if small == large:
        raise StartupError(
            f"the small model would be {large} again (the same weights, not quantized): set TANDEM_SMALL_MODEL_PATH, "
            "TANDEM_SMALL_MODEL_QUANTIZATION=int8, or TANDEM_SMALL_DECODE_WORKERS=0 for one model"
        )
    return ModelNames(large=large, small=small)


def _file_model_name(path: Path | None) -> str:
    """The served id a worker derives from `path` (None: the embedded model); a path that is no model fails here."""
    if path is None:
        return EMBEDDED_MODEL_NAME
    return open_model(path).name
