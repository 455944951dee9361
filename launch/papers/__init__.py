"""The paper reproductions (LARS, Dynamic SGD) and the sweep that tunes them. Checkout only: the wheel holds
`launch/`'s own modules, not this room."""
