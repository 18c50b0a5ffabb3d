"""Run functions (train, evaluate, disco, quickstart): plain Python above the library; the
gin glue (`distillspec.gin_setup`) registers them and the `python -m` entry points call them."""
