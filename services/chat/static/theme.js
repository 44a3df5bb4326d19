// Light, dark, or as the system says ("auto"): the choice is kept in this browser and applied
// as <html data-theme>, which the stylesheet and the code-highlighting theme follow.

const STORAGE = 'tandem.theme';
const NEXT = { auto: 'light', light: 'dark', dark: 'auto' };
const LABEL = { auto: 'Theme: auto', light: 'Theme: light', dark: 'Theme: dark' };
const SYSTEM_DARK = '(prefers-color-scheme: dark)';

export function applyTheme(theme) {
  const root = document.documentElement;
  if (theme === 'auto') delete root.dataset.theme;
  else root.dataset.theme = theme;
  const light = document.getElementById('code-theme-light');
  const dark = document.getElementById('code-theme-dark');
  light.media = theme === 'auto' ? `not all and ${SYSTEM_DARK}` : theme === 'light' ? 'all' : 'not all';
  dark.media = theme === 'auto' ? SYSTEM_DARK : theme === 'dark' ? 'all' : 'not all';
}

/** Applies the stored theme and makes `button` cycle auto → light → dark. */
export function setUpThemeToggle(button) {
  let theme = localStorage.getItem(STORAGE) || 'auto';
  const show = () => {
    applyTheme(theme);
    button.textContent = LABEL[theme];
    button.dataset.theme = theme;
  };
  button.addEventListener('click', () => {
    theme = NEXT[theme] || 'auto';
    localStorage.setItem(STORAGE, theme);
    show();
  });
  show();
}
