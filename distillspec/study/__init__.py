"""The paper study: DistillSpec's recipe, divergence x data, training-curve, theory, quality and
lenience experiments on one target in one command (`python -m distillspec.study`).

`pipeline.study` runs it (JAX); `report` turns its records into tables, figures and findings
(no JAX).
"""
