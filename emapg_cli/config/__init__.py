"""Configuration: one set of pydantic models shared by every command."""

from emapg_cli.config.models import Config
from emapg_cli.config.loading import load_config, preset_dir, list_presets

__all__ = ["Config", "load_config", "preset_dir", "list_presets"]
