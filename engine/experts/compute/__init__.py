"""What runs the routed experts: the MoE block, the executor and its strategies, the native and CPU paths.
The one room that imports the others (tiers/, formats/)."""
