"""DISCO (dynamic speculation lookahead): classifier examples, the classifier, its storage beside
the draft, and the tuning of the lookahead policies. `python -m distillspec.disco` runs it.

`classifier_dir` and `load_classifier` are read from `storage` when first used, so that
`python -m distillspec.disco --help` (which imports this package first) loads no JAX."""

__all__ = ["classifier_dir", "load_classifier"]


def __getattr__(name: str):
    if name in __all__:
        from distillspec.disco import storage

        return getattr(storage, name)
    raise AttributeError(f"module 'distillspec.disco' has no attribute {name!r}")
