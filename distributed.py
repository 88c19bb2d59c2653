"""``linattn.distributed``: context parallelism for the chunked forward (ops/distributed.py)."""
from linattn.ops.distributed import Shard, TorchGroup, cp_forward, shard_of  # noqa: F401
