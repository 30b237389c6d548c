"""``moe-eplb demo``: ``tuning`` (the default scenario: two resources tuned through a workload
shift), ``autoscale`` (one autoscaled resource through a traffic rise) and ``command`` (the click
command, registered with the product's CLI through the entry point group ``moe_eplb.commands``)."""
