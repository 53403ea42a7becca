"""What stands in for a missed expert that we chose not to wait for."""

from __future__ import annotations

from policies.base import DROPPED, SubstituteChoice


class BestResident(SubstituteChoice):
    """The resident expert the router ranks highest (its logit, or sigmoid + balancing bias for a
    DeepSeek-V3-style router: the engine passes what the router ranks) that the row does not already use;
    it takes over the missed expert's gate weight."""

    name = "best-resident"
    needs_logits = True

    def choose(self, row_experts, slot, ranking, is_resident) -> int | None:
        assert ranking is not None, "best-resident needs the router's ranking"
        taken = set(row_experts)
        for e in ranking:
            if e not in taken and is_resident(e):
                return e
        return None


class DropRenormalize(SubstituteChoice):
    """Run nothing in the slot; the row's other gates are scaled up to keep its total mass."""

    name = "drop"

    def choose(self, row_experts, slot, ranking, is_resident) -> int | None:
        # Keep at least one expert per row: dropping every slot would zero the MoE output.
        alive = [e for j, e in enumerate(row_experts) if j != slot and e != DROPPED]
        return DROPPED if alive else None
