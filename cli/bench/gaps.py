"""The two ways an implementation can lack a row (impls.make, train.make raise them; run.py
reports them)."""


class NotImplementedImpl(Exception):
    """The implementation has no function for this op (a gap, reported as such)."""


class NotApplicable(Exception):
    """The implementation does not cover this op at all (left out of the row)."""
