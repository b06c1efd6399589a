//! A folder on a file system of its own, which can be filled to the last block and given its
//! space back: the nemesis puts each shard's PostgreSQL data folder on one, so that "the
//! database's disk is full" is a fault it can inject and heal.
//!
//! The file system is ext4 in a sparse image file, mounted through a loop device (root, and
//! `mkfs.ext4`, `mount`, `umount` and `fallocate` from e2fsprogs and util-linux). Filling it
//! reserves every free block with `fallocate`, which writes nothing: the image on the host
//! grows by the filler's metadata only, whatever the size. No blocks are kept back for root
//! (`mkfs.ext4 -m 0`), so a full volume is full for every user.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

/// The largest a volume's file system can grow to; the image is sparse, so it costs the host
/// only what is written.
const VOLUME_BYTES: u64 = 64 << 30;
/// Filler files a fill makes at most (each takes what the one before could not).
const FILLERS: usize = 4;

/// A mounted volume, unmounted when dropped.
pub struct Volume {
    mountpoint: PathBuf,
    mounted: bool,
}

impl Volume {
    /// Makes a volume in `image` and mounts it on `mountpoint` (made where missing, and left
    /// empty: no `lost+found`), owned by `owner` (a user name for `chown`) with mode 0700, as
    /// PostgreSQL wants its data folder.
    pub fn mount(image: &Path, mountpoint: &Path, owner: Option<&str>) -> anyhow::Result<Self> {
        std::fs::create_dir_all(mountpoint)
            .with_context(|| format!("making {}", mountpoint.display()))?;
        let file =
            std::fs::File::create(image).with_context(|| format!("making {}", image.display()))?;
        file.set_len(VOLUME_BYTES)
            .with_context(|| format!("sizing {}", image.display()))?;
        drop(file);
        run(Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0"])
            .arg(image))
        .context("making a volume's file system (mkfs.ext4, from e2fsprogs)")?;
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(image)
            .arg(mountpoint))
        .context("mounting a volume (root and a loop device are needed)")?;
        let volume = Volume {
            mountpoint: mountpoint.to_owned(),
            mounted: true,
        };
        let lost = mountpoint.join("lost+found");
        if lost.exists() {
            std::fs::remove_dir(&lost).with_context(|| format!("removing {}", lost.display()))?;
        }
        if let Some(owner) = owner {
            run(Command::new("chown").arg(owner).arg(mountpoint))?;
        }
        run(Command::new("chmod").arg("700").arg(mountpoint))?;
        Ok(volume)
    }

    /// Bytes free for an ordinary user.
    pub fn available(&self) -> anyhow::Result<u64> {
        let output = Command::new("stat")
            .args(["-f", "-c", "%a %S"])
            .arg(&self.mountpoint)
            .output()
            .context("running stat -f")?;
        let text = String::from_utf8_lossy(&output.stdout);
        let mut fields = text.split_whitespace().map(str::parse::<u64>);
        match (fields.next(), fields.next()) {
            (Some(Ok(blocks)), Some(Ok(size))) if output.status.success() => Ok(blocks * size),
            _ => bail!("stat -f {}: {}", self.mountpoint.display(), text.trim()),
        }
    }

    /// Takes every free block; returns the bytes taken. The fillers sit at the volume's top,
    /// beside what its user keeps there.
    pub fn fill(&self) -> anyhow::Result<u64> {
        let mut taken = 0;
        for number in 0..FILLERS {
            let mut want = self.available()?;
            let path = self.filler(number);
            // An extent tree needs blocks of its own: ask for less until it fits.
            while want >= 1 << 16 {
                let status = Command::new("fallocate")
                    .arg("-l")
                    .arg(want.to_string())
                    .arg(&path)
                    .stderr(std::process::Stdio::null())
                    .status()
                    .context("running fallocate")?;
                if status.success() {
                    taken += want;
                    break;
                }
                let _ = std::fs::remove_file(&path);
                want = want / 16 * 15 / 4096 * 4096;
            }
            if self.available()? < 1 << 16 {
                break;
            }
        }
        Ok(taken)
    }

    /// Gives back what [`Volume::fill`] took.
    pub fn free(&self) -> anyhow::Result<()> {
        for number in 0..FILLERS {
            let path = self.filler(number);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => {
                    return Err(error).with_context(|| format!("removing {}", path.display()))
                }
            }
        }
        Ok(())
    }

    fn filler(&self, number: usize) -> PathBuf {
        self.mountpoint.join(format!(".filler-{number}"))
    }

    /// Unmounts it; what used it must have stopped. The image stays, sparse (what was written
    /// in it, no more), for whoever reads a failed run: `mount -o loop IMAGE FOLDER`.
    pub fn unmount(&mut self) {
        // Something that still holds it: detach it now, the kernel lets go when they do.
        if std::mem::take(&mut self.mounted)
            && run(Command::new("umount").arg(&self.mountpoint)).is_err()
        {
            let _ = run(Command::new("umount").arg("-l").arg(&self.mountpoint));
        }
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        self.unmount();
    }
}

fn run(command: &mut Command) -> anyhow::Result<()> {
    let output = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    if !output.status.success() {
        bail!(
            "{command:?}: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}
