"""The ElasticJob operator: one DLRover master per ElasticJob resource (needs kopf)."""
