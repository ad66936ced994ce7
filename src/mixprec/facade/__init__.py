"""The concerns of :class:`mixprec.Accelerator`, one module each (docs/design.md, "Where things
live"): run, preparation, loaders, sp_inputs, training_step, exports, checkpoint_session,
processes, lifetime. src/mixprec/accelerator.py combines them; this package imports nothing
itself, so a module below the facade never loads it by accident."""
