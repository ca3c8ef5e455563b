"""Plain PyTorch: ``adapter`` (:class:`~gpusnap.adapters.engines.torch.adapter.TorchAdapter`, your own
callables). No plugin, processes or settings: the worker starts its agent itself."""
