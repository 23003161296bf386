"""Model helpers: loading policies and building tiny local models for tests and the toy task."""
