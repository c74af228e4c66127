"""Admission: decide before scheduling whether a request may enter a saturated pool."""

from epp.admission.saturation import SaturationDetector

__all__ = ["SaturationDetector"]
