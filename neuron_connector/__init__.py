"""neuron_connector."""
