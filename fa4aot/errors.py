"""Typed errors. Each one says what went wrong and, where there is one, what to do next."""


class Fa4aotError(Exception):
    """Base class of every error fa4aot raises on purpose."""


class SpecError(Fa4aotError, ValueError):
    """A spec file is not valid TOML or holds a value out of range. One line: file, field, rule."""


class UnsupportedVariant(Fa4aotError):
    """FA4 itself cannot run this configuration on this arch (e.g. hd512 on sm90)."""


class ContractViolation(Fa4aotError, ValueError):
    """A call breaks what the selected kernel requires (dtype, device, layout, alignment...)."""


class ArtifactMissing(Fa4aotError, LookupError):
    """No artifact in the store serves this call; the message names the build command."""


class FingerprintMismatch(Fa4aotError):
    """A store exists but was built by another toolchain or for another GPU."""


class CorruptArtifact(Fa4aotError):
    """An artifact or its record failed its integrity check; it is never loaded."""


class RuntimeLibraryMissing(Fa4aotError):
    """libcute_dsl_runtime.so could not be located (set FA4AOT_RUNTIME_LIB)."""


class RuntimeLibraryMismatch(Fa4aotError):
    """The libcute_dsl_runtime.so this process loads is not the one the store was built with."""


class BuildError(Fa4aotError):
    """The builder could not run at all (no compiler toolchain, no linker, read-only store)."""


class UnsafeArchive(Fa4aotError):
    """An archive to import holds something other than a store's plain files and directories
    (absolute path, '..', link, device...) or content that fails its checks. Nothing is imported."""


class MergeConflict(Fa4aotError):
    """Stores to merge disagree (one variant id or spec name with different content), or one of
    them fails its checks. Nothing is merged."""


class SettingError(Fa4aotError, ValueError):
    """An FA4AOT_* environment variable holds a value it does not allow. The message names the
    variable, the value and the allowed values (fa4aot/settings.py; `fa4aot doctor` lists all)."""


class Fa4SourceError(Fa4aotError):
    """An FA4 source (`fa4aot build --fa4`) cannot be found, read, or built from: its kernel ABI
    is not one fa4aot models. The message names the source and what to do."""


class NumSmsRequired(Fa4aotError, ValueError):
    """The target arch has no default SM count (sm103): the message names `--num-sms`."""
