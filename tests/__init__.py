"""ckpt's tests, laid out as the package is: tests/<pkg>/ holds the tests of ckpt/<pkg>/, the root
the tests of ckpt's top-level modules, tests/system/ whole jobs end to end. The programs the
multi-process tests run sit in tests/workers/, what several tests share in tests/support/."""
