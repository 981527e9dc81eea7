"""The package version, in a module that imports nothing: the artifact records it, below the
package face that re-exports it."""

__version__ = "0.1.0"
