//! Where the files a model directory names may lie: inside the directory once symlinks are
//! resolved, or, for a Hugging Face cache snapshot, in its repository's `blobs/`.

use std::path::{Component, Path, PathBuf};

use candle_core::{bail, Result};

/// A model directory, canonical, and where the files it names may resolve to.
pub(crate) struct ModelDir {
    shown: PathBuf,
    canonical: PathBuf,
    /// `<repo>/blobs` when the directory is a Hugging Face cache snapshot `<repo>/snapshots/<rev>`.
    blobs: Option<PathBuf>,
}

impl ModelDir {
    /// `dir`, canonicalized, and the `blobs/` of its repository when it is a cache snapshot.
    pub(crate) fn new(dir: &Path) -> Result<Self> {
        let canonical = dir.canonicalize().map_err(|e| {
            candle_core::Error::msg(format!(
                "cannot resolve model directory {}: {e}",
                dir.display()
            ))
        })?;
        let snapshots = canonical.parent().filter(|p| p.ends_with("snapshots"));
        let blobs = snapshots
            .and_then(Path::parent)
            .map(|repo| repo.join("blobs"));
        Ok(Self {
            shown: dir.to_path_buf(),
            canonical,
            blobs,
        })
    }

    /// The file `name` (a plain file name) of the directory, with symlinks resolved; errors call
    /// it "`what` path`whence`". A link whose target is missing or outside gets one error for
    /// both, so that errors do not tell whether a file outside the directory exists.
    pub(crate) fn resolve(&self, name: &str, what: &str, whence: &str) -> Result<PathBuf> {
        let name = plain_file_name(name)?;
        let path = self.shown.join(name);
        let Ok(meta) = path.symlink_metadata() else {
            bail!("{what} {}{whence} does not exist", path.display())
        };
        if !meta.file_type().is_symlink() {
            if !meta.is_file() {
                bail!("{what} {}{whence} is not a file", path.display())
            }
            return Ok(self.canonical.join(name));
        }
        let inside = |p: &Path| {
            p.starts_with(&self.canonical) || self.blobs.as_ref().is_some_and(|b| p.starts_with(b))
        };
        match path.canonicalize() {
            Ok(target) if inside(&target) && target.is_file() => Ok(target),
            _ => bail!(
                "{what} {}{whence} is a symbolic link that does not resolve to a file inside the \
                 model directory",
                path.display()
            ),
        }
    }
}

/// `name` when it is a plain file name: one normal path component, no separator of any platform.
pub(super) fn plain_file_name(name: &str) -> Result<&str> {
    let mut parts = Path::new(name).components();
    let plain = matches!((parts.next(), parts.next()), (Some(Component::Normal(p)), None) if p == name)
        && !name.contains(['/', '\\', '\0']);
    if !plain {
        bail!(
            "{name:?} is not a plain file name inside the model directory (no path separators, \
             no `..`, not absolute)"
        )
    }
    Ok(name)
}
