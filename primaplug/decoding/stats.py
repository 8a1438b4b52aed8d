"""What speculation did: how many drafted tokens the ring verified and kept, and where the time went."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculationStats:
    steps: int = 0  # verification trips that carried drafted tokens
    drafted: int = 0  # drafted tokens the target decided on (kept or rejected; none after a generation stopped)
    accepted: int = 0
    draft_s: float = 0.0  # time spent drafting
    verify_s: float = 0.0  # time the ring spent on the trips that carried drafted tokens

    @property
    def acceptance_rate(self) -> float:
        """Kept over decided drafted tokens (0 before any was decided)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def describe(self) -> str:
        if not self.drafted:
            return "no drafted token verified yet"
        return (f"{self.accepted}/{self.drafted} drafted tokens kept ({self.acceptance_rate:.0%}) over {self.steps} "
                f"trips; drafting took {self.draft_s:.2f} s, verifying {self.verify_s:.2f} s")
