"""Model parallelism over a rank mesh ([Note: the rank mesh] in parallel/mesh.py).

- ``compose.py``: the one function that applies them to a model at ``prepare()``, in order
  ([Note: the order of the parallelisms]);
- ``mesh.py``: the (dp, sp, tp) layout of the ranks and its process subgroups;
- ``materialize.py``: meta-device models given their weights, shard by shard;
- ``tensor/``: tensor parallelism (AutoTP): ``plan.py`` chooses what is split, ``presets.py``
  holds the model-family presets, ``layers.py`` the split layers and their collectives,
  ``engine.py`` the placements the Engine reads under TP (norm and found_inf agreed over
  the whole world, checkpoints), ``apply.py`` the split and full tensors from split ones
  (``get_state_dict``, ``save_16bit_model``);
- ``sequence/``: sequence parallelism (AutoSP, Ulysses): ``inputs.py`` slices a batch and
  gives the loss normaliser, ``ulysses.py`` runs every SDPA call over the whole sequence.

``accelerator.py`` only calls into this package.
"""

from .mesh import Mesh, build_mesh

__all__ = ["Mesh", "build_mesh"]
