"""The causality audit: does any output of a model depend on an input it must not see?"""
from .audit import CausalityError, CausalityReport, as_function, assert_causal, audit_causal

__all__ = ["audit_causal", "assert_causal", "as_function", "CausalityReport", "CausalityError"]
