"""Searches that fit a method to a model (``quickdraft tune``): layer-skip profiles."""
