"""The framework-free core: no torch, tensorflow, keras or horovod import anywhere below this package."""
