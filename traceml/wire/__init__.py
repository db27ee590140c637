"""The typed wire between ranks, launchers and the aggregator (protobuf package
``traceml.wire.v1``).

The ``.proto`` files under ``proto/traceml/wire/v1/`` are the single source of truth; the
modules in ``traceml/wire/v1/`` are generated from them by ``tools/gen_proto.sh`` and committed
(see ``docs/wire.md`` for why). This module re-exports the message classes under short names.
"""

from traceml.wire.v1.finish_pb2 import EndState, NodeExit, RankEnd, RankFinish, SenderCounts
from traceml.wire.v1.rank_pb2 import RankIdentity
from traceml.wire.v1.samples_pb2 import GpuSample, ProcessSample, SystemSample
from traceml.wire.v1.service_pb2 import (
    Ack,
    Batch,
    ClockEcho,
    ClockOffset,
    FinalizeReply,
    FinalizeRequest,
    LiveRank,
    NodeClaim,
    NodeClaimReply,
    NodeDown,
    NodeExitAck,
    NodeGoodbye,
    NodeHeartbeat,
    NodeInterrupted,
    NodeUp,
    RelayAck,
    RelayDown,
    RelayFrame,
    RelayUp,
    StallNotice,
    SummarizeReply,
    SummarizeRequest,
)
from traceml.wire.v1.service_pb2_grpc import (
    AggregatorServicer,
    AggregatorStub,
    add_AggregatorServicer_to_server,
)
from traceml.wire.v1.step_pb2 import CollectiveState, FlopsCount, Progress, StepColumns


def end_state_name(value: int) -> str:
    """``EndState.END_STATE_SIGNALED`` -> ``"signaled"`` (the name used in reports)."""
    return EndState.Name(value).removeprefix("END_STATE_").lower()


__all__ = [
    "Ack",
    "AggregatorServicer",
    "AggregatorStub",
    "Batch",
    "ClockEcho",
    "ClockOffset",
    "CollectiveState",
    "EndState",
    "FinalizeReply",
    "FinalizeRequest",
    "FlopsCount",
    "GpuSample",
    "LiveRank",
    "NodeClaim",
    "NodeClaimReply",
    "NodeDown",
    "NodeExit",
    "NodeExitAck",
    "NodeGoodbye",
    "NodeHeartbeat",
    "NodeInterrupted",
    "NodeUp",
    "RelayAck",
    "RelayDown",
    "RelayFrame",
    "RelayUp",
    "ProcessSample",
    "Progress",
    "RankEnd",
    "RankFinish",
    "RankIdentity",
    "SenderCounts",
    "StallNotice",
    "StepColumns",
    "SummarizeReply",
    "SummarizeRequest",
    "SystemSample",
    "add_AggregatorServicer_to_server",
    "end_state_name",
]
