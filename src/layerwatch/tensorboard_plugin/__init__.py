"""The LAYERWATCH TensorBoard tab: every layer at once, over time.

TensorBoard finds it through the ``tensorboard_plugins`` entry point. Importing this package
imports neither torch nor the backend's dependencies: TensorBoard loads every plugin at start.
"""

from __future__ import annotations

from typing import Any

from tensorboard.plugins import base_plugin

from layerwatch.vocabulary import PLUGIN_NAME


class LayerwatchLoader(base_plugin.TBLoader):
    """Loads the tab, and asks TensorBoard to keep every sample of its data.

    TensorBoard keeps 10 samples per tag of a plugin it does not know. The tab's data is a
    few tags of compact per-step summaries, so all of them are kept, unless the user set
    ``--samples_per_plugin layerwatch=N`` themselves.
    """

    def fix_flags(self, flags: Any) -> None:
        samples = getattr(flags, "samples_per_plugin", None)
        if isinstance(samples, dict):
            samples.setdefault(PLUGIN_NAME, 0)  # 0: keep all (both readers)

    def load(self, context: base_plugin.TBContext) -> base_plugin.TBPlugin:
        from layerwatch.tensorboard_plugin.plugin import LayerwatchPlugin

        return LayerwatchPlugin(context)
