"""What the chat process's lifespan owns: the long-lived clients and the parts that hold state
between requests. Routes get them through services.chat.deps; domain code is handed only the
parts it uses."""

from __future__ import annotations

from dataclasses import dataclass, field

from redis.asyncio import Redis

from services.chat.attach_reads import AttachReads
from services.chat.auth import Authenticator
from services.chat.config import ChatConfig
from services.chat.difficulty import DifficultyJudge
from services.chat.door import Door
from services.chat.fanout import FanoutHub
from services.chat.models_view import ModelsView
from services.chat.moderation import InputCheck
from services.chat.prompt import LoadedTokenizer
from services.chat.shadow import Shadows
from services.chat.stream_slots import StreamSlots
from services.chat.summaries import Summaries
from tandem.bus import Bus
from tandem.quota import TokenBuckets
from tandem.store import ConversationStore


@dataclass
class ChatState:
    config: ChatConfig
    auth: Authenticator  # the API keys and the throttle on wrong ones
    store: ConversationStore
    redis: Redis  # short commands, from a bounded pool
    fanout: FanoutHub  # live token log reads, one per reply, shared by its streams
    attach_reads: AttachReads  # new streams' meta reads, one per reply at a time, through a bounded queue
    stream_slots: StreamSlots  # open streams, against the instance's and each user's limits
    bus: Bus
    models: ModelsView
    tokenizer: LoadedTokenizer = field(default_factory=LoadedTokenizer)  # loaded at start
    quotas: TokenBuckets | None = None  # the users' token buckets; None: no quotas apply
    difficulty: DifficultyJudge | None = None  # scores messages for `auto`; None: the fallback rule decides
    summaries: Summaries | None = None  # the conversation summary jobs; None: none are written
    input_check: InputCheck | None = None  # loaded at start (before any request); None: none configured
    shadows: Shadows | None = None  # the rollout's shadow replies; None: none start
    door: Door = field(default_factory=Door)  # free messages refused at once while the routers refuse them
