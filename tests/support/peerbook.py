"""A peerbook that only remembers the rejections recorded against peers (what the audit watches blame)."""

from __future__ import annotations


class Peerbook:
    def __init__(self) -> None:
        self.rejections: list[tuple[str, str]] = []

    def record_rejection(self, peer_id: str, reason: str, *, counts: bool = True) -> int:
        self.rejections.append((peer_id, reason))
        return len(self.rejections)
