"""Integrations with training frameworks that drive their own loop.

``mixprec.integrations.transformers``: the Hugging Face ``Trainer`` (and its subclasses,
TRL's included) on mixprec's engines (docs/integrations/transformers.md).
"""
