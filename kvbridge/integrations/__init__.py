"""Engine and model integrations: one subpackage per engine, each importing
only kvbridge's public API and its engine (lazily). ``import kvbridge`` imports
none of them; import the one you use (``kvbridge.integrations.transformers``)."""
