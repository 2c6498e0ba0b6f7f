"""Helpers of the test suite that are not tests themselves: the reference model, the
invariant and history checkers, worker handlers run in subprocesses, the fault proxy,
shifted clocks and the attack helpers."""
