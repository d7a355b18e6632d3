"""Model parallelism: layers of one model on several devices (``place``) or processes
(``pipeline``). A model stays a plain ``nn.Sequential``; these functions split it."""

from paratrain.parallel.placement import PlacedSequential, place
from paratrain.parallel.split import balanced_bounds, bounds_from_split_points, layer_costs, sequential_layers

__all__ = [
    "PlacedSequential",
    "balanced_bounds",
    "bounds_from_split_points",
    "layer_costs",
    "place",
    "sequential_layers",
]
