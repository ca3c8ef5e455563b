"""The weights path: a worker's named buffers out of its images at capture, and back into it at restore.

* :mod:`.exchange` — the daemon's half of the buffer exchange with an agent (``Offload``, ``Reload``), and
  the one batcher (:func:`~.exchange.fd_batches`) that keeps every frame within ``wire.MAX_FDS`` descriptors.
* :mod:`.capture` — capture-side steps: stage each agent's announced buffers in the buffer store, have the
  workers write them out in parallel, commit them at publish, hand them back if the capture fails.
* :mod:`.restore` — restore-side step: every restored worker gets its buffers back (prefilled arenas
  handed over, the rest read back), in parallel.
* :mod:`.prefill` — device memory gpusnapd fills while CRIU restores (``--gpu-prefill``), and the node's
  :class:`~.prefill.PrefillSupport` (held by the operations' dependencies, not by ``gpu/``).
* :mod:`.devicefill` — the CUDA VMM calls that create, fill and export that memory.

The blobs themselves, their tiers and budgets are the buffer store's (``gpusnap.daemon.store.buffers``,
``gpusnap.daemon.store.tiers``). Operations make two calls per direction: capture
(:func:`.capture.offload` in the ``offload`` phase, :func:`.capture.commit` at publish) and restore
(:func:`.prefill.start` before CRIU, :func:`.restore.reload` in the ``reload-buffers`` phase).
"""
