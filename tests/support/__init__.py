"""What the tests share: stub servers, fixtures' data, conditions to wait on."""
