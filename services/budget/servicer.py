"""BudgetService servicer: translates protobuf <-> domain types, nothing else."""

from __future__ import annotations

from ragline.errors import Unimplemented
from ragline.v1 import budget_pb2_grpc


def _missing(method: str) -> Unimplemented:
    return Unimplemented(
        f"BudgetService.{method} is not available yet: the etcd-backed task ledger is still "
        "to be built"
    )


class BudgetServicer(budget_pb2_grpc.BudgetServiceServicer):
    async def OpenTask(self, request, context):
        raise _missing("OpenTask")

    async def Reserve(self, request, context):
        raise _missing("Reserve")

    async def Settle(self, request, context):
        raise _missing("Settle")

    async def Cancel(self, request, context):
        raise _missing("Cancel")

    async def GetLedger(self, request, context):
        raise _missing("GetLedger")

    async def CloseTask(self, request, context):
        raise _missing("CloseTask")
