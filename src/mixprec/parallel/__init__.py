"""Model parallelism over a rank mesh ([Note: the rank mesh] in parallel/mesh.py).

- ``mesh.py``: the (dp, tp) layout of the ranks and its process subgroups;
- ``tensor/``: tensor parallelism (AutoTP): ``plan.py`` chooses what is split, ``presets.py``
  holds the model-family presets, ``layers.py`` the split layers and their collectives,
  ``engine.py`` what the data-parallel engines add under TP (norm and found_inf agreed over
  the whole world), ``state.py`` full tensors from split ones (``get_state_dict``,
  ``save_16bit_model``);
- ``sequence/``: sequence parallelism (AutoSP, Ulysses): ``inputs.py`` slices a batch and
  gives the loss normaliser, ``ulysses.py`` runs every SDPA call over the whole sequence.

``accelerator.py`` only calls into this package.
"""

from .mesh import Mesh, build_mesh

__all__ = ["Mesh", "build_mesh"]
