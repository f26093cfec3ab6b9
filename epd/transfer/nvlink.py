"""NVLink backend placeholder: reports why it is unavailable.

dlslime 0.1.23's published wheel is built without NVLink (`dlslime._slime_c._BUILD_NVLINK`
is False and there is no `dlslime.NVLinkEndpoint`). Its source has an NVLinkEndpoint
(CUDA IPC / fabric memory) with a different registration API; supporting it needs a
dlslime build with `BUILD_NVLINK` and a GPU to test on, so `auto` skips this backend and
creating it explicitly raises `TransferError` with the reason.
"""

from __future__ import annotations

from epd.transfer.base import TransferError


def unavailable_reason() -> str | None:
    try:
        import dlslime
    except Exception as exc:
        return f"cannot import dlslime: {exc}"
    if not getattr(dlslime._slime_c, "_BUILD_NVLINK", False) or not hasattr(
        dlslime, "NVLinkEndpoint"
    ):
        return "this dlslime build has no NVLink endpoint (dlslime._slime_c._BUILD_NVLINK is False)"
    return "dlslime has an NVLink endpoint, but epd does not drive it yet"


class NvlinkTransferEngine:
    name = "nvlink"

    def __init__(self, host: str = "127.0.0.1", *, engine_id: str | None = None) -> None:
        raise TransferError(f"nvlink transfer backend unavailable: {unavailable_reason()}")
