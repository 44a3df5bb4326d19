"""KV handoff data path: a prefill worker's KvSender writes a reply's prompt KV, block by block, over
UCXX straight into the blocks a decode worker's KvReceiver reserved for it.

The gRPC side (tandem.v1.KvHandoff: Reserve -> transfer -> Commit, or Release) decides which blocks
and where, and hands the sender the reservation's token; this package moves bytes, and only into a
reservation whose token the transfer carries. The unit of transfer is one KV block: a contiguous
(num_layers, 2, block_size, num_kv_heads, head_dim) tensor (Engine.block_view), sent as raw bytes
and received zero-copy into the destination block. The wire protocol is in tandem.kvtransfer.wire.

Both classes use ucxx's process-wide context (its progress mode and UCX_* settings are the
process's); the process calls ucxx.reset() at shutdown, after stopping receivers and closing senders.
"""

from tandem.kvtransfer.receiver import Destination, KvReceiver
from tandem.kvtransfer.sender import KvSender, KvTransferError
from tandem.kvtransfer.wire import new_token

__all__ = ["Destination", "KvReceiver", "KvSender", "KvTransferError", "new_token"]
