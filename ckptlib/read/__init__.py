"""Reading a checkpoint without restoring a job: :func:`ckptlib.open` (``view``), lazy
tensorstore arrays (``lazy_array``), zarr3 and safetensors exports (``to_zarr3``,
``to_safetensors``) and comparisons (``compare``). See docs/read.md."""
