"""Layer 3: catalog, alias to variant resolution, download cache, probe."""

from ._embedded import default_model_path, distribution_file

__all__ = ["default_model_path", "distribution_file"]
