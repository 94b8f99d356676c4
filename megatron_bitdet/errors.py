"""Error types the CLI maps to exit codes: a BitdetInputError is unusable input (exit 2)."""


class BitdetError(Exception):
    """A failure the user can act on; printed without a traceback."""

    exit_code = 1


class BitdetInputError(BitdetError):
    """Unusable input: a malformed recipe, a truncated or foreign file, a corrupt checkpoint."""

    exit_code = 2


class DeterminismViolation(BitdetError):
    """The requested setup has no deterministic path (fail closed); carries every violation at once."""

    exit_code = 2

    def __init__(self, violations):
        self.violations = list(violations)
        lines = [f"  [{v.rule_id}] {v.message}\n      why: {v.why}\n      fix: {v.fix}" for v in self.violations]
        super().__init__(
            f"{len(self.violations)} feature(s) have no deterministic path:\n" + "\n".join(lines)
        )
