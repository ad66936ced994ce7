"""Objects returned by ``Accelerator.prepare``."""
