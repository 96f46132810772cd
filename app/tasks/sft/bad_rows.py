"""What a run does with the rows it cannot train on (``task.bad_rows``), for every task that reads rows of
conversations or pairs (sft, dpo and those built on them), map-style or streamed.

``refuse`` (the default): every file is read whole first, and one sentence counts its bad rows, names the
first few (place and reason) and points to ``skip``. ``skip``: the run trains on the rest; each bad row is
written to ``<run>/skipped_rows.jsonl`` (file, place, reason, the row as it came) and counted in the log's
``data:`` line; a file with more than ``task.max_bad_fraction`` of its rows bad is refused all the same
(a wrong column name or template makes every row bad, which is no data to train on).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from app.config import ConfigError

if TYPE_CHECKING:
    from app.tasks.sft.records import Places

NAMED = 3
"""The bad rows a refusal names (it counts them all)."""


@dataclass(frozen=True)
class Skipped:
    """A bad row: its file, how its place is counted (``line``, ``row`` or ``byte``), the place, why it is
    bad (a sentence that names the place), and the row as it came (its JSON text)."""

    origin: str
    unit: str
    place: int
    reason: str
    row: str

    def record(self) -> dict[str, object]:
        """Its line in ``skipped_rows.jsonl``: ``{"file", "line" | "row" | "byte", "reason", "row"}``."""
        return {"file": self.origin, self.unit: self.place, "reason": self.reason, "row": self.row}


def judge(bad: list[Skipped], read: int, origin: str, skip: bool, max_fraction: float) -> None:
    """Refuse a file's bad rows in one sentence, unless skipping them (and they are few enough)."""
    if not bad:
        return
    named = "; ".join(_clause(b) for b in sorted(bad, key=lambda b: b.place)[:NAMED])
    more = f"; and {len(bad) - NAMED:,} more" if len(bad) > NAMED else ""
    share = len(bad) / max(read, 1)
    if not skip:
        raise ConfigError(f"{origin} has {len(bad):,} bad row(s) of {read:,}: {named}{more} — fix them, or train on "
                          "the others with task.bad_rows=skip (each then written to <run>/skipped_rows.jsonl).")
    if share > max_fraction:
        raise ConfigError(f"{origin} has {len(bad):,} bad rows of {read:,} ({share:.0%}), more than task."
                          f"max_bad_fraction={max_fraction}: {named}{more} — fix the file (a column name or the chat "
                          "template may be wrong for it all), or raise task.max_bad_fraction.")


def _clause(bad: Skipped) -> str:
    """``line 8: message 3 of 'messages' has no 'role'`` (the reason without its file, which the sentence names)."""
    reason = bad.reason.rstrip(".")
    for prefix in (f"{bad.origin} ", f"{bad.origin}, "):
        reason = reason.removeprefix(prefix)
    return reason


def skipped_of(encoded: Any, places: Places) -> list[Skipped]:
    """The bad rows of encoded rows (a ``datasets.map`` output or one batch's columns: ``place``, ``error``,
    ``raw``)."""
    return [Skipped(places.origin, places.unit, place, reason, raw)
            for place, reason, raw in zip(encoded["place"], encoded["error"], encoded["raw"], strict=True) if reason]


def as_records(bad: list[Skipped]) -> list[dict[str, object]]:
    """Bad rows as plain data (gathered across processes, kept in a checkpoint)."""
    return [asdict(b) for b in bad]


def from_records(records: list[dict[str, object]]) -> list[Skipped]:
    return [Skipped(**r) for r in records]  # type: ignore[arg-type]
