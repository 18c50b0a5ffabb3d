"""DISCO (dynamic speculation lookahead): classifier examples, the classifier, its storage beside
the draft, and the tuning of the lookahead policies. `python -m distillspec.disco` runs it."""

from distillspec.disco.storage import classifier_dir, load_classifier

__all__ = ["classifier_dir", "load_classifier"]
